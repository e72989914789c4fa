from pathlib import Path

from edgc.config import config_table_markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_config_table_is_generated_from_the_dataclass():
    assert config_table_markdown() in README.read_text(), "run: .venv/bin/python scripts/update_readme.py"


def test_readme_starts_with_the_two_setup_commands():
    text = README.read_text()
    assert "make run" in text.split("##")[0] and "make test" in text.split("##")[0]
