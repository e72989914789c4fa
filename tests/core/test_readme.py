"""The README is a front page: short, with install, the hook, the integrations and one result near
the top, and no generated block but the results summary (copied from the results pages) and the GPU
block."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_the_readme_is_a_front_page_of_at_most_250_lines():
    assert len(README.read_text().splitlines()) <= 250


def test_install_the_hook_the_integrations_and_a_result_come_within_the_first_100_lines():
    head = "\n".join(README.read_text().splitlines()[:100])
    assert "make run" in head and "make test" in head and "pip install -e ." in head
    assert "ddp_model.register_comm_hook(state, edgc_hook)" in head
    for guide in ("ddp", "fsdp", "torchft", "tensor-parallel", "pipelines", "lightning", "accelerate", "hf-trainer"):
        assert f"(docs/guides/{guide}.md)" in head, guide
    summary = head.split("<!-- results-summary:start -->", 1)[1].split("<!-- results-summary:end -->", 1)[0]
    assert re.search(r"\| DDP, 1 Gbit/s links.*\| \d\.\d\d× of native DDP \|", summary)


def test_no_generated_block_but_the_summary_and_the_gpu_one():
    blocks = re.findall(r"<!-- ([\w-]+):start -->", README.read_text())
    assert blocks == ["results-summary", "gpu"]
    assert "## Measured on a GPU" in README.read_text().split("<!-- gpu:start -->")[0]


def test_the_results_summary_is_the_one_the_script_copies_from_the_results_pages():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "to_docs.py"), "results-summary", "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def test_every_link_of_the_readme_points_at_a_file_that_exists():
    for target in re.findall(r"\]\(((?!https?:)[^)#]+)", README.read_text()):
        assert (ROOT / target).exists(), target
