"""Link calibration: gloo all-reduce time vs message size on the emulated network, against bytes / rate.

The worker (``python -m edgc_bench.calibrate SIZE_MB ...``) runs on every host (one process each,
env:// rendezvous from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT); rank 0 prints one JSON line per
size: {"mb", "seconds"} (median of ``REPEATS`` timed all-reduces after one untimed).

The expectation: an all-reduce of S bytes over W hosts moves 2·(W−1)/W·S bytes out of (and into)
every host (ring: reduce-scatter then all-gather; for W = 2, gloo's halving-doubling sends the same
amount), so on links of R bit/s it cannot take less than 2·(W−1)/W·S·8 / R seconds.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from datetime import timedelta

REPEATS = 3


def ideal_seconds(size_bytes: float, world: int, rate_mbit: float) -> float:
    return 2 * (world - 1) / world * size_bytes * 8 / (rate_mbit * 1e6)


def worker(sizes_mb: list[float]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        for mb in sizes_mb:
            tensor = torch.ones(int(mb * 2**20 / 4))
            times = []
            for i in range(REPEATS + 1):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                if i:
                    times.append(time.perf_counter() - start)
            if dist.get_rank() == 0:
                print(json.dumps({"mb": mb, "seconds": statistics.median(times)}), flush=True)
    finally:
        dist.destroy_process_group()


def rows(results: list[dict], world: int, rate_mbit: float | None) -> list[dict]:
    out = []
    for r in results:
        size = r["mb"] * 2**20
        ideal = ideal_seconds(size, world, rate_mbit) if rate_mbit else None
        out.append({**r, "ideal_s": ideal, "ratio": r["seconds"] / ideal if ideal else None,
                    "effective_mbit": 2 * (world - 1) / world * size * 8 / r["seconds"] / 1e6})
    return out


def table(calibration: list[dict], rate_mbit: float | None) -> str:
    head = ("| all-reduce size | measured | bytes / rate | measured ÷ ideal | effective rate per host |\n"
            "| ---: | ---: | ---: | ---: | ---: |\n")
    lines = []
    for r in calibration:
        ideal = f"{r['ideal_s'] * 1e3:.1f} ms" if r["ideal_s"] else "–"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "–"
        lines.append(f"| {r['mb']:g} MiB | {r['seconds'] * 1e3:.1f} ms | {ideal} | {ratio} | "
                     f"{r['effective_mbit']:.0f} Mbit/s |")
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker([float(a) for a in sys.argv[1:]])
