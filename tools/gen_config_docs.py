"""Write docs/config.md (the config reference) from hpcrl/config/schema.py; `--check`: exit 1 if it is stale.

    .venv/bin/python tools/gen_config_docs.py            # after changing schema.py or validate.py's CHOICES / RANGES
    .venv/bin/python tools/gen_config_docs.py --check    # what CI runs (tests/test_config_reference.py)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "config.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/config.md instead of writing it")
    parser.add_argument("--out", type=Path, default=DOC, help="where to write (default docs/config.md)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from hpcrl.config.reference import render, undocumented

    missing = undocumented()
    if missing:
        print(f"keys without a meaning (add a comment above or beside them in hpcrl/config/schema.py): "
              f"{', '.join(missing)}", file=sys.stderr)
        return 1
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is out of date with hpcrl/config/schema.py; run: python tools/gen_config_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
