"""DiLoCo's outer sync on the device: its default method, resumed from a checkpoint.

On a CUDA machine (NCCL, one process) every inner and outer step after the first outer step runs
under ``torch.cuda.set_sync_debug_mode("error")``: a blocking copy of a loaded error feedback to the
device, or any other host synchronisation outside `edgc.device.timing.host_reads_allowed`, raises. Run
again under ``TORCH_CUDA_SANITIZER=1`` (docs/gpu.md), the sanitizer reports a tensor freed or reused
on one stream while another still reads it, the race a resume exposes when the loaded error
feedback is moved to the device and replaced on the jobs' side stream. The resumed run must end bit
for bit where the uninterrupted one does, under CUDA's deterministic kernels.

Without CUDA the same file runs on the CPU over gloo with two processes (the suite's pool): it
keeps the test from rotting and checks the resume on the CPU, nothing more.
"""

import io
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # distributed_harness

from test_cuda import CUDA, SYNC_WARNING, TinyGPT, _device, _run, batch, deterministic, strict_sync  # noqa: E402

from edgc.integrations.diloco import DEFAULT_OUTER_SYNC, DiLoCo  # noqa: E402

SYNC_EVERY, OUTER_STEPS, RESUME_AT_OUTER = 3, 4, 2


def _build(device, seed: int):
    torch.manual_seed(seed)
    model = TinyGPT().to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return model, inner, DiLoCo(None, [model], inner, outer, SYNC_EVERY)


def _checkpoint(model, inner, diloco) -> dict:
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": diloco.state_dict()}, saved)
    saved.seek(0)
    return torch.load(saved, weights_only=False)


def _inner_steps(rank, device, model, inner, start: int, stop: int, strict_from: int) -> list[str]:
    """Inner steps ``start``..``stop`` (every SYNC_EVERY-th ends in an outer step), under the sync
    debug mode from ``strict_from`` on; the synchronisation warnings raised from Python code."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(start, stop):
            tokens, targets = batch(rank, step, device)
            with strict_sync("error" if CUDA else "warn") if step >= strict_from else _nothing():
                logits = model(tokens)
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                loss.backward()
                inner.step()
                inner.zero_grad()
    return [str(w.message) for w in caught if SYNC_WARNING in str(w.message)]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def diloco_resume_worker(rank, world_size, backend):
    total, split = SYNC_EVERY * OUTER_STEPS, SYNC_EVERY * RESUME_AT_OUTER
    with deterministic():
        device = _device()
        model, inner, diloco = _build(device, seed=0)
        with diloco:
            _inner_steps(rank, device, model, inner, 0, total, strict_from=SYNC_EVERY)
        uninterrupted = _flat(model)

        model, inner, diloco = _build(device, seed=0)
        with diloco:
            _inner_steps(rank, device, model, inner, 0, split, strict_from=SYNC_EVERY)
            checkpoint = _checkpoint(model, inner, diloco)
        model, inner, diloco = _build(device, seed=123)
        model.load_state_dict(checkpoint["model"])
        inner.load_state_dict(checkpoint["inner"])
        diloco.load_state_dict(checkpoint["diloco"])
        with diloco:
            # strict from the first step after the resume: the loaded error feedback's move to the
            # device happens inside the next outer step, where no host synchronisation is allowed
            synced = _inner_steps(rank, device, model, inner, split, total, strict_from=split)
        return {"uninterrupted": uninterrupted, "resumed": _flat(model), "synced": synced}


def test_diloco_default_outer_sync_resumes_exactly_on_the_device():
    assert DEFAULT_OUTER_SYNC == "quant3-2s"  # the method this test is about; update the docstring if it moves
    backend, world_size = ("nccl", 1) if CUDA else ("gloo", 2)
    results = _run(diloco_resume_worker, world_size, backend)
    for result in results:
        assert result["synced"] == [], result["synced"][:3]
        assert torch.equal(result["uninterrupted"], result["resumed"])
    for other in results[1:]:
        assert torch.equal(other["resumed"], results[0]["resumed"])  # identical replicas
