"""Every script in examples/ runs on CPU (2 processes; the HSDP one 4), and its EDGC hook really ran
(llama_tp_dp.py, TP × DP against one process, has its own test: test_llama_tp_dp.py).

Each example prints ``[rank R] edgc: step S phase P rank r sent B of RAW bytes`` from its last
optimizer step: both ranks must report the last step (the hook counted every sync), the
compress phase, and fewer bytes sent than an uncompressed all-reduce would send.
"""

import subprocess
import sys

import pytest
from distributed_harness import hosted_store

from .conftest import REPO, run_script, summaries

# --standalone: torchrun's agent serves the group's store on a port it binds as 0 (none to race for)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TORCHRUN4 = [*TORCHRUN[:-1], "4"]  # 2 replicas × 2 shards

# example → (command, optimizer steps it runs by default)
EXAMPLES = {
    "ddp_plain": (TORCHRUN, 20),
    "hf_transformers": (TORCHRUN, 16),
    "hf_trainer": (TORCHRUN, 16),
    "accelerate_example": (TORCHRUN, 12),
    "lightning_trainer": ([sys.executable], 12),  # Lightning starts the second process itself
    "fsdp2_hsdp": (TORCHRUN4, 12),
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_runs_and_compresses(name):
    launcher, steps = EXAMPLES[name]
    env = {}
    if launcher not in (TORCHRUN, TORCHRUN4):  # Lightning starts the processes: they meet at a store served here
        store = hosted_store()
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    proc = run_script([*launcher, f"examples/{name}.py"], **env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    found = summaries(output)
    nproc = 4 if launcher is TORCHRUN4 else 2
    assert sorted(found) == list(range(nproc)), output[-4000:]
    for summary in found.values():
        assert summary["step"] == steps - 1  # 0-based: one hook step per optimizer step
        assert summary["phase"] == "compress" and summary["rank"] > 0
        assert 0 < summary["sent"] < summary["raw"] / 2
    assert found[0] == found[nproc // 2]  # replicas (of the same shards, for HSDP) agree


def test_plain_diff_is_the_change_from_the_vanilla_script():
    """examples/ddp_plain.diff, reversed, applies to ddp_plain.py: the diff shown is the real one."""
    proc = subprocess.run(
        ["git", "apply", "--check", "--reverse", "examples/ddp_plain.diff"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
