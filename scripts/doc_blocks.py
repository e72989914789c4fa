"""The generated blocks of the manual: where each lives, how one is read, replaced and checked (the
producers of scripts/producers/, run by `scripts/to_docs.py KIND …`, write them through here).

A block is the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``. Each name occurs in
exactly one page under docs/ (or in README.md), so a producer names the block it fills and this
module finds the page; moving a block to another page needs no change to the producer. Every
producer reads and writes its blocks through this module; none splits a page at its markers itself.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def name_of(marker: str) -> str:
    """The block's name in one of its markers (``<!-- NAME:start -->``)."""
    return marker.split()[1].rsplit(":", 1)[0]


def page_of(name: str, root: Path = ROOT) -> Path:
    """The one page (docs/**/*.md or README.md) that holds block ``name``."""
    start, _ = markers(name)
    pages = [
        p
        for p in sorted((root / "docs").rglob("*.md")) + [root / "README.md"]
        if p.is_file() and start in p.read_text()
    ]
    if len(pages) != 1:
        raise SystemExit(f"block {name!r}: expected in exactly one page, found in {[str(p) for p in pages] or 'none'}")
    return pages[0]


def read(text: str, name: str) -> str:
    """Block ``name``'s content in ``text``, as it stands between its markers."""
    start, end = markers(name)
    if start not in text or end not in text:
        raise SystemExit(f"no {start} … {end} block")
    return text.split(start, 1)[1].split(end, 1)[0]


def replace(text: str, name: str, body: str, add_missing: bool = False) -> str:
    """``text`` with block ``name``'s content replaced by ``body``. The markers must be there, unless
    ``add_missing``: then an empty block is added at the end of the text first."""
    start, end = markers(name)
    if add_missing and (start not in text or end not in text):
        text = text.rstrip() + f"\n\n{start}\n{end}\n"
    read(text, name)  # refuses a text without the block
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{body.rstrip()}\n{end}{rest.split(end, 1)[1]}"


def write(name: str, body: str, page: Path | None = None, add_missing: bool = False) -> Path:
    """Replace block ``name`` in ``page`` (default: the page that holds it); returns the page."""
    page = page or page_of(name)
    page.write_text(replace(page.read_text(), name, body, add_missing))
    return page


def is_current(name: str, body: str, page: Path | None = None) -> bool:
    """Whether block ``name`` already holds ``body`` (what `write` would leave there)."""
    text = (page or page_of(name)).read_text()
    return replace(text, name, body) == text
