"""The getting-started page's script runs as written (2 processes under torchrun, CPU), logs the
decisions the page quotes, and the landing page shows lines of that same script."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting-started.md"


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def quickstart() -> str:
    [script] = [block for block in python_blocks(PAGE) if block.startswith("# quickstart.py")]
    return script


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quickstart")
    (folder / "quickstart.py").write_text(quickstart())
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # = torchrun; the agent's store on a port it binds as 0
        "--nproc_per_node",
        "2",
        "quickstart.py",
    ]
    return subprocess.run(
        command,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=240,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )


def test_the_script_runs_as_written_and_compresses(ran):
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-4000:]
    [line] = re.findall(r"loss [\d.]+; sent ([\d,]+) of ([\d,]+) gradient bytes", ran.stdout)  # rank 0's
    sent, raw = (int(number.replace(",", "")) for number in line)
    assert 0 < sent < raw / 2


def test_rank_0_logs_each_decision_once_as_the_page_quotes_it(ran):
    logged = ran.stderr.splitlines()
    assert sum("warm-up is over" in line for line in logged) == 1  # rank 0 alone speaks
    assert any(re.match(r"step \d+: EDGC moves rank \d+ → \d+ \(budget", line) for line in logged)
    prose = PAGE.read_text().split("# quickstart.py", 1)[1].split("## Add EDGC", 1)[0]
    quoted = [" ".join(q.split()) for q in re.findall(r"`(step \d+: EDGC[^`]*)`", prose, flags=re.S)]
    assert len(quoted) == 2
    for quote in quoted:  # "…" stands for the rest of the line
        pattern = re.escape(quote.rstrip(")").rstrip("…")).replace("…", ".*")
        assert any(re.match(pattern, line) for line in logged), quote


def test_the_landing_page_shows_lines_of_that_script():
    [core] = python_blocks(ROOT / "docs" / "index.md")
    script = quickstart().splitlines()
    lines = [line for line in core.splitlines() if line.strip() and line.strip() != "..."]
    assert len(lines) >= 5 and all(line in script for line in lines), lines
    assert "pip install -e ." in (ROOT / "docs" / "index.md").read_text()
