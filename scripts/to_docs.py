"""Copy one kind of figure from a run's output into the manual's generated blocks.

    .venv/bin/python scripts/to_docs.py KIND [ARGS …]     # e.g. gpu docs/gpu/before, bench runs/bench/bench.md
    .venv/bin/python scripts/to_docs.py --list            # the kinds, each with its module

The one way to run a producer: each kind is a module of scripts/producers/, registered by kind in
``producers.PRODUCERS``. ARGS are the kind's own (``to_docs.py KIND --help``, or the module's
docstring). The blocks are found, replaced and checked by scripts/doc_blocks.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
# The producers import doc_blocks and each other from here, and the packages from this checkout's src/.
sys.path[:0] = [str(SCRIPTS), str(SCRIPTS.parent / "src")]
from producers import PRODUCERS, producer, summary  # noqa: E402


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] == "--list":
        for kind, module in sorted(PRODUCERS.items()):
            print(f"{kind:24} scripts/producers/{module}.py  {summary(kind)}")
        return 0
    return producer(argv[0]).main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
