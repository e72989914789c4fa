"""The simulator's dispatches per job term, counted on this engine (`edgc_sim.engine_launches`).

    python -m edgc_bench.engine_launches [--out docs/engine/launches.json]

For every `edgc_sim.engine_launches.SETTINGS` combination, the probe jobs (`PROBES`) are run through
`LowRankCompressor.reduce` on fake tensors and their dispatches counted (`count_job`: the steady
second call, `edgc_probes.dispatch_count`'s rule); each term's dispatches are fitted to them. The
hook's own dispatches per job and per step are fitted to the committed GPT-2 hook counts
(docs/gpu/count/count.json, held to the engine by tests/bench/test_dispatch_count.py) less their
jobs' modelled dispatches. tests/bench/test_engine_launches.py holds the table to fresh counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from edgc_probes.dispatch_count import DispatchCounter
from edgc_probes.gpt2_layout import GPT2_SIZES
from edgc_probes.hook_steps import _zeros
from edgc_probes.host_reads import counted_host_reads
from edgc_probes.stand_ins import counting_communicator
from edgc_sim import engine_launches as el
from edgc_sim import engine_model as em
from edgc_sim.collectives import gpt2_gradient_shapes
from edgc_sim.presets import ModelSpec

REPO = Path(__file__).resolve().parents[2]
COUNT = REPO / "docs" / "gpu" / "count" / "count.json"
COMMAND = "python -m edgc_bench.engine_launches"


def count_job(shapes: Sequence[tuple], rank: int, setting: el.Setting) -> int:
    """Dispatches of one steady `LowRankCompressor.reduce` call on fake gradients of these shapes (the
    second call: the first builds the call's buffers); ``setting.tracked``: within a step begun on the
    engine's state, as the hook's are."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from edgc import LowRankCompressor, LowRankConfig

    dtype = torch.bfloat16 if setting.half_gradients else torch.float32
    with counted_host_reads(_zeros), FakeTensorMode():
        compressor = LowRankCompressor(LowRankConfig(force_accelerator_kernels=setting.accelerator))
        comm = counting_communicator(2 if setting.divides else 1)
        names = [f"t{k}" for k in range(len(shapes))]
        grads = [torch.zeros(shape, dtype=dtype) for shape in shapes]
        for _ in range(2):  # the counter of the second call is kept
            if setting.tracked:
                compressor.state.begin_step()
            with DispatchCounter() as counter:
                compressor.reduce(names, grads, rank, comm, measure_error=setting.measure_error)
            if setting.tracked:
                compressor.state.end_step(False)
    return counter.total


def probe_terms(shapes: Sequence[tuple]) -> dict:
    return em.JobLayout.plan(shapes, el.PROBE_RANK).terms()


def fit_jobs(settings: Sequence[el.Setting] = el.SETTINGS) -> dict:
    """Per setting key, each term's dispatches (`edgc_sim.engine_launches.fit_job_launches`)."""
    return {
        setting.key: el.fit_job_launches(lambda shapes: count_job(shapes, el.PROBE_RANK, setting), probe_terms)
        for setting in settings
    }


def gpt2_shapes(size: str) -> list:
    layers, width, heads, vocab, context = GPT2_SIZES[size]
    return gpt2_gradient_shapes(ModelSpec(layers, width, heads, context, vocab, vocab_pad=1, positions=context))


def fit_hook(jobs_table: dict, count: dict) -> dict:
    """The hook's dispatches per job and per step, from the committed GPT-2 hook counts (``count``)."""
    setting = el.Setting(True, count["dtype"] == "bfloat16", count["world_size"] > 1, False, True)
    table = el.LaunchTable(jobs_table, {"per_step": 0, "per_job": 0})
    rows = []
    for row in count["hook"]:
        cap = None if row["ddp_default"] else row["bucket_cap_mb"]
        jobs = em.engine_jobs(gpt2_shapes(row["model"]), 2, accelerator=True, bucket_cap_mib=cap)
        layouts = [em.JobLayout.plan(job, count["rank"]) for job in jobs]
        rows.append((row["dispatches"], sum(table.job(setting, layout.terms()) for layout in layouts), len(jobs)))
    return el.fit_hook_launches(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=el.TABLE_PATH, help="the table to write")
    args = p.parse_args(argv)
    jobs = fit_jobs()
    count = json.loads(COUNT.read_text())
    table = {
        "command": COMMAND,
        "torch": torch.__version__,
        "rule": count["rule"],
        "probe_rank": el.PROBE_RANK,
        "probes": [list(map(list, probe)) for probe in el.PROBES],
        "terms": list(el.TERMS),
        "jobs": jobs,
        "hook": fit_hook(jobs, count),
    }
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.out}: {len(jobs)} settings, hook {table['hook']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
