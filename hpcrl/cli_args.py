"""The arguments and parsing that the `hpcrl` subcommands share (hpcrl/cli.py, cli_slurm.py, cli_ckpt.py):
CONFIG and its KEY=VALUE overrides, --verbose, options before or after the positionals, and the config's
warnings on stderr."""

from __future__ import annotations

import argparse
import sys

from omegaconf import DictConfig

from hpcrl.config.validate import config_warnings


def add_config_arguments(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument("config", nargs="?" if optional else None, help="YAML recipe, e.g. configs/grpo_tiny.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="override any key, e.g. trainer.total_steps=3 actor.parallel.tensor_parallel=2")
    p.add_argument("--skip-path-checks", action="store_true",
                   help="do not check that model/data paths exist (and skip checks that read the model), "
                        "e.g. when preparing a cluster recipe elsewhere")


def add_verbose_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="show every rank's library output (vLLM, transformers, megatron, torch) on the terminal "
                        "too, as well as in {logging.dir}/rank*.log (sets logging.verbose=true)")


class IntermixedParser(argparse.ArgumentParser):
    """A parser that takes its options before, between or after its positionals (`hpcrl plan CONFIG
    KEY=VALUE --nodes 2` as well as `hpcrl plan --nodes 2 CONFIG KEY=VALUE`): argparse's intermixed
    parsing, for the parsers it can serve (not one whose positional is a sub-command)."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        nested = any(a.nargs in (argparse.PARSER, argparse.REMAINDER) for a in self._get_positional_actions())
        if self._intermixing or nested:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:  # parse_known_intermixed_args calls parse_known_args twice: those take the branch above
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def print_config_warnings(cfg: DictConfig, command: str) -> None:
    """What runs but biases the update (hpcrl.config.validate.config_warnings), on stderr."""
    for warning in config_warnings(cfg):
        print(f"hpcrl {command}: warning: {warning}", file=sys.stderr)
