"""docs/extending.md's files, written out and imported as the page writes them (which registers
them), and undone after: the extension tests of the harness and of the bench share them."""

from __future__ import annotations

import importlib
import re
import sys
from contextlib import contextmanager
from pathlib import Path

from edgc.policies.signals import SIGNALS
from edgc.sync.sync_methods import SYNC_METHODS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


def page_files() -> dict[str, str]:
    """The page's Python blocks that open with ``# NAME.py``, by file name."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    return {m.group(1): block for block in blocks if (m := re.match(r"# (\w+\.py)", block))}


@contextmanager
def page_extensions(folder: Path):
    """The page's files, written to ``folder`` and imported (which registers them); on exit their
    registrations and modules are undone, so no other test sees them."""
    files = page_files()
    assert sorted(files) == ["my_compressor.py", "my_signal.py"]
    for name, text in files.items():
        (folder / name).write_text(text)
    sys.path.insert(0, str(folder))
    before = {id(registry): set(registry) for registry in (SIGNALS, SYNC_METHODS)}
    try:
        yield [importlib.import_module(name.removesuffix(".py")) for name in sorted(files)]
    finally:
        for registry in (SIGNALS, SYNC_METHODS):
            for name in set(registry) - before[id(registry)]:
                del registry[name]
        for name in files:
            sys.modules.pop(name.removesuffix(".py"), None)
        sys.path.remove(str(folder))
