"""`hpcrl ckpt list|verify|export-hf RUN_DIR`: inspect, check and export a run's checkpoints.

RUN_DIR is a run folder (with checkpoints/ under it), a checkpoints folder, or one checkpoint
folder (step_XXXXXXXX). hpcrl.cli mounts these with `add_commands`; `python -m hpcrl.cli_ckpt`
runs them alone. Exit status: 0 fine, 1 a corrupt/unusable checkpoint, 2 nothing to work on.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from hpcrl.checkpoint.store import MANIFEST, STEP_RE, TMP_RE, CheckpointStore

EXIT_CORRUPT = 1
EXIT_MISSING = 2
EXIT_USAGE = 2  # a request the checkpoint cannot serve (argparse also exits 2)


def resolve(run_dir: str) -> tuple[CheckpointStore, Path | None]:
    """The store of RUN_DIR, and the one checkpoint folder when RUN_DIR names one."""
    p = Path(run_dir)
    if (p / MANIFEST).is_file() or STEP_RE.match(p.name):
        return CheckpointStore(p.parent), p
    if (p / "checkpoints").is_dir():
        return CheckpointStore(p / "checkpoints"), None
    if p.is_dir():
        return CheckpointStore(p), None
    raise FileNotFoundError(f"{p}: no such folder")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _pick(store: CheckpointStore, one: Path | None, step: int | None) -> Path | None:
    if one is not None:
        return one
    if step is not None:
        return store.find(step)
    return store.latest_valid()


def cmd_list(args: argparse.Namespace) -> int:
    store, one = resolve(args.run_dir)
    infos = [i for i in store.list() if one is None or i.path == one]
    debris = sorted(p.name for p in store.root.iterdir() if TMP_RE.match(p.name)) if store.root.is_dir() else []
    if not infos and not debris:
        print(f"no checkpoints under {store.root}", file=sys.stderr)
        return EXIT_MISSING
    print(f"{'step':>10}  {'saved':<19}  {'size':>9}  valid")
    for i in infos:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.created)) if i.created else "?"
        valid = "yes" if i.valid else "NO: " + "; ".join(i.problems)
        print(f"{i.step:>10}  {when:<19}  {_size(i.size):>9}  {valid}{'   <- latest' if i.latest else ''}")
    for name in debris:
        print(f"{'':>10}  {name}: an unfinished save (ignored; the next commit removes it)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store, one = resolve(args.run_dir)
    if one is not None or args.step is not None:
        path = _pick(store, one, args.step)
        if path is None:
            print(f"no checkpoint of step {args.step} under {store.root}", file=sys.stderr)
            return EXIT_MISSING
        targets = [path]
    else:
        targets = [i.path for i in store.list()]
    if not targets:
        print(f"no checkpoints under {store.root}", file=sys.stderr)
        return EXIT_MISSING
    bad = 0
    for path in targets:
        problems = store.verify(path, checksums=True)
        if problems:
            bad += 1
            print(f"{path.name}: CORRUPT")
            for p in problems:
                print(f"  - {p}")
        else:
            m = store.manifest(path)
            print(f"{path.name}: OK ({len(m['files'])} files, {_size(m['total_bytes'])}, checksums verified)")
    return EXIT_CORRUPT if bad else 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from hpcrl.checkpoint.export import export_hf, export_peft

    store, one = resolve(args.run_dir)
    path = _pick(store, one, args.step)
    if path is None:
        what = f"of step {args.step}" if args.step is not None else "that verifies"
        print(f"no checkpoint {what} under {store.root}", file=sys.stderr)
        return EXIT_MISSING
    problems = store.verify(path, checksums=args.verify)
    if problems:
        print(f"{path.name} is unusable: " + "; ".join(problems), file=sys.stderr)
        return EXIT_CORRUPT
    export = export_peft if args.lora else export_hf
    info = export(path, args.out, role=args.role, model_path=args.model_path)
    what = "LoRA adapters (PEFT folder)" if args.lora else "weights"
    lay = info["layout"]
    saved_at = f"TP={lay['tp']} PP={lay['pp']}" + (f" EP={lay['ep']}" if lay.get("ep", 1) > 1 else "")
    print(f"exported {args.role} {what} of {path.name} (step_count {info['step_count']}, saved at {saved_at}) to "
          f"{info['out']}: {info['tensors']} tensors in {info['files']} file(s), {_size(info['bytes'])}; "
          f"config/tokenizer from {info['model_path']}")
    return 0


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A missing folder or file is a message and exit 2, not a traceback (also under hpcrl.cli)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (FileNotFoundError, FileExistsError) as e:
            print(f"hpcrl ckpt {args.ckpt_command}: {e}", file=sys.stderr)
            return EXIT_MISSING
        except ValueError as e:  # e.g. --lora on a checkpoint without adapters
            print(f"hpcrl ckpt {args.ckpt_command}: {e}", file=sys.stderr)
            return EXIT_USAGE

    return run


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Add `ckpt` with its actions to the `hpcrl` command's subparsers."""
    p = sub.add_parser("ckpt", help="list, verify or export a run's checkpoints")
    actions = p.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")

    a = actions.add_parser("list", help="steps, times, sizes, validity and the latest pointer")
    a.add_argument("run_dir", help="run folder, its checkpoints/ folder, or one checkpoint folder")
    a.set_defaults(func=_guarded(cmd_list))

    a = actions.add_parser("verify", help="full sha256 verification (exit 1 naming the corrupt files)")
    a.add_argument("run_dir")
    a.add_argument("--step", type=int, default=None, help="only this step (default: every checkpoint)")
    a.set_defaults(func=_guarded(cmd_verify))

    a = actions.add_parser("export-hf", help="write a role of a checkpoint as a HuggingFace folder (offline)")
    a.add_argument("run_dir")
    a.add_argument("--out", required=True, help="the HF folder to create (must not exist or be empty)")
    a.add_argument("--step", type=int, default=None, help="default: the latest valid checkpoint")
    a.add_argument("--role", default="actor", help="actor (default) or reference")
    a.add_argument("--model-path", default=None,
                   help="HF folder for config/tokenizer files (default: model.path of the checkpoint's config)")
    a.add_argument("--verify", action="store_true", help="verify checksums before exporting (sizes always)")
    a.add_argument("--lora", action="store_true",
                   help="a LoRA run: write the adapters as a PEFT folder (default: merged into the base weights)")
    a.set_defaults(func=_guarded(cmd_export_hf))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hpcrl", description="hpcrl checkpoint tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
