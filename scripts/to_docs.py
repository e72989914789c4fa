"""Copy one kind of figure from a run's output into the manual's generated blocks.

    .venv/bin/python scripts/to_docs.py KIND [ARGS …]     # e.g. gpu docs/gpu/before, bench runs/bench/bench.md
    .venv/bin/python scripts/to_docs.py --list            # the kinds, and the script of each

ARGS are the kind's own (``to_docs.py KIND --help``, or the script's docstring); each script's own
name runs the same producer (``scripts/gpu_to_docs.py …`` = ``to_docs.py gpu …``). The blocks are
found, replaced and checked by scripts/doc_blocks.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import PRODUCERS, producer  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] == "--list":
        for kind, script in sorted(PRODUCERS.items()):
            print(f"{kind:24} scripts/{script}.py")
        return 0
    return producer(argv[0]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
