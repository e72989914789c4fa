"""Regenerate the generated parts of README.md (run after changing EDGCConfig).

    .venv/bin/python scripts/update_readme.py
"""
from pathlib import Path

from edgc.config import config_table_markdown

START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"


def render(readme: str) -> str:
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{config_table_markdown()}\n{END}{tail}"


if __name__ == "__main__":
    path = Path(__file__).resolve().parent.parent / "README.md"
    path.write_text(render(path.read_text()))
