"""What a rank's Python logging shows on the terminal, and what goes only to the rank's log file.

The bytes themselves are routed by the capture (`hpcrl.controller.stderr_log`): everything a rank
writes to fd 1 / fd 2 lands in `{logging.dir}/rank{R}.{host}.log`, and in quiet mode (the default of
`hpcrl run`, `hpcrl submit` and the sbatch scripts; `--verbose` / `logging.verbose=true` turns it
off) only the rank's terminal streams reach the terminal. This module decides which log records
are written to those streams:

- hpcrl's own records (loggers `hpcrl.*`) at the configured level on the controller, WARNING and
  worse on a worker, whose lines name it (`[rank 3 node7] ...`);
- ERROR and worse from any logger, on any rank (named likewise on a worker).

Everything else (transformers' and megatron's warnings, Python warnings) goes to stderr, i.e. to
the file alone. vLLM logs through its own handler to stdout, so to the file too (at
VLLM_LOGGING_LEVEL: `hpcrl run` sets INFO, WARNING with --verbose).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from hpcrl.controller.stderr_log import is_quiet, terminal

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DATE = "%Y-%m-%d %H:%M:%S"
# libraries whose INFO lines are per-call chatter (urllib3, filelock: per request or lock); their
# warnings and errors still reach the files. vLLM sets its own level from VLLM_LOGGING_LEVEL.
NOISY_LOGGERS = ("transformers", "urllib3", "filelock")


def is_hpcrl_record(record: logging.LogRecord) -> bool:
    return record.name == "hpcrl" or record.name.startswith("hpcrl.")


class TerminalFilter(logging.Filter):
    """hpcrl's own records, and ERROR or worse from any logger: what a quiet terminal shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return is_hpcrl_record(record) or record.levelno >= logging.ERROR


class FileOnlyFilter(logging.Filter):
    """The complement of TerminalFilter: records that only the rank's file gets in quiet mode."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not TerminalFilter().filter(record)


def _handler(stream: TextIO, fmt: str, level: int, flt: logging.Filter | None = None) -> logging.Handler:
    h = logging.StreamHandler(stream)
    h.setFormatter(logging.Formatter(fmt, _DATE))
    h.setLevel(level)
    if flt is not None:
        h.addFilter(flt)
    return h


def setup_worker_logging(label: str) -> None:
    """A worker rank's root logger: WARNING and worse. In quiet mode hpcrl's records and errors go
    to the terminal with the rank named (`label`, e.g. "rank 3 node7"), the rest to stderr (the
    rank's file); in verbose mode all to stderr, which the terminal shows anyway."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.setLevel(logging.WARNING)
    fmt = f"[{label}] {_FORMAT}" if label else _FORMAT
    if is_quiet():
        root.addHandler(_handler(terminal(err=True), fmt, logging.WARNING, TerminalFilter()))
        root.addHandler(_handler(sys.stderr, fmt, logging.WARNING, FileOnlyFilter()))
    else:
        root.addHandler(_handler(sys.stderr, fmt, logging.WARNING))
    logging.captureWarnings(True)  # warnings.warn -> logger py.warnings -> stderr (the file)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def setup_controller_logging(log_file: str, level: str = "INFO") -> None:
    """The controller's log: every record at `level` appended to `log_file` (controller.log); on the
    terminal, in quiet mode hpcrl's records and errors of any logger, in verbose mode all of them."""
    from pathlib import Path

    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(level)
    for h in list(root.handlers):
        root.removeHandler(h)
    file_handler = logging.FileHandler(log_file, mode="a")
    file_handler.setFormatter(logging.Formatter(_FORMAT, _DATE))
    root.addHandler(file_handler)
    root.addHandler(_handler(terminal(), _FORMAT, logging.NOTSET, TerminalFilter() if is_quiet() else None))
    logging.captureWarnings(True)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
