"""Link calibration: gloo all-reduce time vs message size on the emulated network, against bytes / rate.

The worker (``python -m edgc_bench.link_calibration SIZE_MB ...``) runs on every host (one process each,
env:// rendezvous from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT); rank 0 prints one JSON line per
size: {"mb", "seconds", "mean_s"} (median and mean of ``repeats(mb)`` timed all-reduces after one
untimed, each timed on every host and taken as the minimum over hosts: the collective alone, no
peer wait). Each starts after a barrier and ``GAP_S`` of idle time, which refills tc tbf's token
bucket as the compute between a training step's collectives does, so a message up to the bucket's
burst passes at once here too.

``SIZES_MB`` (what `edgc bench` measures) starts at 4 KiB: in a few seconds in all, the sizes pin
the fixed cost of one collective (≤ 64 KiB) and the rate (≥ 4 MiB), the two numbers edgc_sim's link
fit takes (edgc_sim.bench_link.fit_bench_link); 256 and 512 KiB show the tbf burst (the rows record
the burst the links were given). The low-rank methods pay the fixed cost a dozen times per step and
send a few hundred KiB per collective, about one burst.

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

REPEATS = 3  # timed all-reduces per size from 1 MiB up (64 MiB: ~0.6 s each)
SMALL_REPEATS = 30  # below 1 MiB (0.3-4 ms each on a shared CPU: a late wake-up is a large share)
SIZES_MB = (4 / 1024, 64 / 1024, 256 / 1024, 512 / 1024, 1, 4, 16, 64)  # 4 KiB … 64 MiB, ~5 s at 1 Gbit/s
GAP_S = 0.005  # idle before each timed all-reduce: the tbf bucket (2 ms at the rate) is full again


def repeats(mb: float) -> int:
    return REPEATS if mb >= 1 else SMALL_REPEATS


def size_label(mb: float) -> str:
    """'4 KiB', '256 KiB', '16 MiB'."""
    return f"{mb * 1024:g} KiB" if mb < 1 else f"{mb:g} MiB"


def ideal_seconds(size_bytes: float, world: int, rate_mbit: float) -> float:
    return 2 * (world - 1) / world * size_bytes * 8 / (rate_mbit * 1e6)


def worker(sizes_mb: list[float]) -> None:
    import torch
    import torch.distributed as dist

    from edgc.distributed.comm import Communicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        for mb in sizes_mb:
            tensor = torch.ones(int(mb * 2**20 / 4))
            mine = torch.zeros(repeats(mb))
            for i in range(repeats(mb) + 1):
                dist.barrier()
                time.sleep(GAP_S)
                start = time.perf_counter()
                dist.all_reduce(tensor)
                if i:
                    mine[i - 1] = time.perf_counter() - start
            # Each repetition's time is the minimum over hosts: the host whose sleep ended last waited
            # for nobody (the same estimator as the training traces, edgc_sim.calibrate.link_times).
            times = torch.stack(Communicator().all_gather(mine)).min(dim=0).values.tolist()
            if dist.get_rank() == 0:
                print(
                    json.dumps({"mb": mb, "seconds": statistics.median(times), "mean_s": statistics.fmean(times)}),
                    flush=True,
                )
    finally:
        dist.destroy_process_group()


def rows(results: list[dict], world: int, rate_mbit: float | None) -> list[dict]:
    """The worker's lines plus the bound bytes / rate and the tbf burst the links were given."""
    from edgc_sim.tbf import burst_bytes

    out = []
    for r in results:
        size = r["mb"] * 2**20
        ideal = ideal_seconds(size, world, rate_mbit) if rate_mbit else None
        out.append(
            {
                **r,
                "ideal_s": ideal,
                "ratio": r["seconds"] / ideal if ideal else None,
                "effective_mbit": 2 * (world - 1) / world * size * 8 / r["seconds"] / 1e6,
                "rate_mbit": rate_mbit,
                "burst_bytes": burst_bytes(rate_mbit) if rate_mbit else 0,
            }
        )
    return out


def table(calibration: list[dict], rate_mbit: float | None) -> str:
    head = (
        "| all-reduce size | measured (median) | mean | bytes / rate | measured ÷ ideal | effective rate per host |\n"
        "| ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    lines = []
    for r in calibration:
        ideal = f"{r['ideal_s'] * 1e3:.2f} ms" if r["ideal_s"] else "–"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "–"
        mean = f"{r['mean_s'] * 1e3:.2f} ms" if r.get("mean_s") is not None else "–"
        lines.append(
            f"| {size_label(r['mb'])} | {r['seconds'] * 1e3:.2f} ms | {mean} | {ideal} | {ratio} | "
            f"{r['effective_mbit']:.0f} Mbit/s |"
        )
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker([float(a) for a in sys.argv[1:]])
