"""The generated blocks of the manual: where each lives and how a script replaces one.

A block is the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``. Each name occurs in
exactly one page under docs/ (or in README.md), so a script names the block it fills and this
module finds the page; moving a block to another page needs no change to the script.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


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


def replace(text: str, name: str, body: str) -> str:
    """``text`` with block ``name``'s content replaced by ``body`` (the markers must be there)."""
    start, end = markers(name)
    if start not in text or end not in text:
        raise SystemExit(f"no {start} … {end} block")
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{body.rstrip()}\n{end}{rest.split(end, 1)[1]}"


def write(name: str, body: str, page: Path | None = None) -> Path:
    """Replace block ``name`` in ``page`` (default: the page that holds it); returns the page."""
    page = page or page_of(name)
    page.write_text(replace(page.read_text(), name, body))
    return page
