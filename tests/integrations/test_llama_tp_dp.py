"""examples/llama_tp_dp.py: a Llama-style model, TP 2 × DP 2 through DTensor, EDGC on the DP dimension.

One 4-process run (16 steps: 4 uncompressed warm-up steps, then EDGC compresses), against the same
training in one process (the example's `single_process_losses`, run here):
- while gradients are sent uncompressed, every step's loss equals the single process's to 1e-5 —
  TP's sharded arithmetic and the DP average of local shards are the full model's;
- once EDGC compresses, the run leaves that trajectory (compression acts) and still learns;
- every rank agrees on the loss, the phase and the rank (the TP shards decide together: `decision_group`),
  and the replicas of each TP shard hold identical parameters.
"""

import importlib.util
import re
import sys

import pytest

from .conftest import REPO, run_script, summaries

STEP = re.compile(r"\[rank (\d+)\] step (\d+) loss ([0-9.]+) phase (\w+) rank (\w+)")
DIGEST = re.compile(r"\[rank (\d+)\] parameters (\w+)")


def load_example():
    spec = importlib.util.spec_from_file_location("llama_tp_dp", REPO / "examples" / "llama_tp_dp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_tp2_dp2_matches_the_single_process_until_edgc_compresses():
    proc = run_script(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # the agent's store on a port it binds as 0
            "--nproc_per_node",
            "4",
            "examples/llama_tp_dp.py",
        ]
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    steps: dict[int, dict] = {}  # step -> {rank: (loss, phase)}
    for rank, step, loss, phase, compression_rank in STEP.findall(output):
        steps.setdefault(int(step), {})[int(rank)] = (float(loss), phase, compression_rank)
    example = load_example()
    assert sorted(steps) == list(range(1, example.STEPS + 1))
    assert all(len(set(by_rank.values())) == 1 and len(by_rank) == 4 for by_rank in steps.values())
    losses = {s: by_rank[0][0] for s, by_rank in steps.items()}
    # the loss of step s is computed before step s's sync: it has seen the updates of steps 1 … s − 1
    first_compressed = min(s for s, by_rank in steps.items() if by_rank[0][1] == "compress")
    assert first_compressed >= 4
    reference = example.single_process_losses(first_compressed + 1, replicas=2)
    for step in range(1, first_compressed + 1):
        assert losses[step] == pytest.approx(reference[step - 1], abs=1e-5), step
    assert abs(losses[first_compressed + 1] - reference[first_compressed]) > 1e-4  # compressed updates differ
    assert sum(losses[s] for s in (14, 15, 16)) / 3 < sum(losses[s] for s in (1, 2, 3)) / 3 - 1.0
    digests = {int(rank): digest for rank, digest in DIGEST.findall(output)}
    assert digests[0] == digests[2] and digests[1] == digests[3] and digests[0] != digests[1]
    found = summaries(output)
    assert sorted(found) == [0, 1, 2, 3]
    for summary in found.values():
        assert summary["phase"] == "compress" and summary["rank"] > 0 and 0 < summary["sent"] < summary["raw"] / 2
