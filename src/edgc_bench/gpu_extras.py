"""The GPU run's parts that are not in its default list (``--parts`` names them): the simulator's device
profile, the CPU's dispatch count, the overlap runs, EDGC against ``powerSGD_hook`` at GPT-2 sizes and
ranks, and the orthonormalisation's accuracy. The first H200 run measured them
(docs/gpu/h200-2026-11-27); what the engine's changes since move is in the default parts."""

from __future__ import annotations

from pathlib import Path

import torch


def device_profile(cuda: bool = True) -> dict:
    """The simulator's host measurements, taken on the GPU, beside its h100 preset (``cuda`` False: a
    smoke run, which has no GPU to measure even where one is at hand)."""
    from edgc_sim.hardware import DEVICES
    from edgc_sim.host import measure_cuda

    if not (cuda and torch.cuda.is_available()):
        raise RuntimeError("the device profile needs a CUDA GPU")
    preset = DEVICES["h100"]
    fields = (
        "name",
        "matmul_flops",
        "mfu",
        "mem_bytes_per_s",
        "launch_s",
        "skinny_read_bytes_per_s",
        "skinny_write_bytes_per_s",
        "skinny_flops_per_s",
        "orth_flops_per_s",
    )
    measured = measure_cuda()
    torch.cuda.empty_cache()
    return {"measured": measured, "preset": {name: getattr(preset, name) for name in fields}}


def count_part(record, settings: dict) -> None:
    """count.json: the dispatches of one compressed step per model and bucket size, on the CPU."""
    from edgc_probes.dispatch_count import count_report

    caps = settings["bucket_caps"]
    report = count_report(settings["sizes"], caps, rank=settings["rank"], progress=lambda line: print(line, flush=True))
    record.data.update(report)
    record.save()


def overlap_part(record, settings: dict) -> None:
    """overlap.json and its traces: does backward wait for the collectives (`edgc_bench.gpu_overlap`)."""
    from .gpu_overlap import overlap

    overlap_settings = {
        "cuda": settings["cuda"],
        "size": settings["overlap_size"],
        "rank": settings["overlap_rank"],
        "steps": settings["overlap_steps"],
        "micro_batch": settings["micro_batch"],
        "seq_len": min(settings["seq_len"], 1024),
    }
    half = settings["part_limit_s"] / 2
    record.data.update(overlap(Path(settings["out"]), overlap_settings, settings["delay_ms"], timeout=half))
    record.save()


def engine_part(record, settings: dict) -> None:
    """engine.json: EDGC against ``powerSGD_hook`` (`edgc_bench.gpu_engine.engine`), in this process's group."""
    from .gpu_engine import engine

    engine_settings = {
        "cuda": settings["cuda"],
        "sizes": settings["sizes"],
        "ranks": settings["ranks"],
        "goal_rank": settings["rank"],
        "bucket_caps": settings["bucket_caps"],
        "micro_batch": settings["micro_batch"],
        "seq_len": settings["seq_len"],
        "timed": settings["timed"],
        "skip_steps": settings["skip_steps"],
    }
    result = engine(0, 1, engine_settings, settings["part_limit_s"] - 20, str(record.path))
    record.data.update(result)
    record.save()


def orth_part(record, settings: dict) -> None:
    """orth.json: the engine's orthonormalisation against batched Householder QR."""
    from .orthonormalization import compare

    if not settings["cuda"]:
        rows = compare(torch.device("cpu"), shapes=((2, 4, 64),), repeats=1)
        record.data.update({"device": "cpu (smoke run)", "rows": rows})
    else:
        record.data.update({"device": torch.cuda.get_device_name(0), "rows": compare(torch.device("cuda"))})
    record.save()
