"""The outer-sync part of the GPU bench: one DiLoCo outer step at GPT-2 sizes, time and memory.

DiLoCo (`edgc.integrations.diloco.DiLoCo`) on a process group of one (NCCL on the GPU), a GPT-2 with
fp32 parameters and AdamW as the inner optimizer, θ_global kept in pinned host memory as DiLoCo
keeps it. The outer step runs inside the inner optimizer's ``step()`` that ends each ``sync_every``
inner steps; its cost is that call's time minus a plain inner ``step()``'s, and its memory the peak
during that call beyond what the process held just before it (parameters, gradients, AdamW's
moments and DiLoCo's error feedback from the outer step before: the training state). Both are taken
at the second outer step, when the error feedback exists, for each method in ``methods``: the default
(`DEFAULT_OUTER_SYNC`) and a bf16 cast, the uncompressed reference.
"""

from __future__ import annotations

import gc

import torch

from .gpu_support import DeviceTimer, gpt2, memory_allocated, peak_memory, vocabulary

SYNC_EVERY = 2
OUTER_STEPS = 2  # the second is measured: its error feedback was made by the first


def _inner_step(model, inner, tokens, timer: DeviceTimer) -> tuple:
    """forward, backward, then the inner optimizer's step marked on its own: (start, end) marks
    around ``inner.step()`` and the memory held just before it."""
    model(input_ids=tokens, labels=tokens).loss.backward()
    held = memory_allocated(tokens.device)
    peak_memory(tokens.device, reset=True)
    start = timer.mark()
    inner.step()
    end = timer.mark()
    inner.zero_grad(set_to_none=False)
    return start, end, held, peak_memory(tokens.device)


def outer_step(size: str, method: str, settings: dict, device: torch.device) -> dict:
    """One measured outer step of DiLoCo with the outer sync ``method`` on GPT-2 ``size``."""
    from edgc.integrations.diloco import DiLoCo

    torch.manual_seed(0)
    model = gpt2(size, device, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    tokens = torch.randint(0, vocabulary(size), (settings["micro_batch"], settings["seq_len"])).to(device)
    timer, marks = DeviceTimer(device), []
    with DiLoCo(None, [model], inner, outer, SYNC_EVERY, sync_method=method):
        for _ in range(SYNC_EVERY * OUTER_STEPS):
            marks.append(_inner_step(model, inner, tokens, timer))
    timer.synchronize()
    seconds = [timer.seconds(start, end) for start, end, _, _ in marks]
    plain = [s for k, s in enumerate(seconds) if (k + 1) % SYNC_EVERY]  # inner steps with no outer step
    start, end, held, peak = marks[-1]
    row = {
        "model": size,
        "method": method,
        "params": params,
        "sync_every": SYNC_EVERY,
        "inner_step_s": min(plain),
        "outer_step_s": seconds[-1] - min(plain),
        "outer_step_s_all": [s for k, s in enumerate(seconds) if not (k + 1) % SYNC_EVERY],
        "held_bytes": held,
        "peak_beyond_held_bytes": None if held is None else peak - held,
        "peak_beyond_held_bytes_per_param": None if held is None else (peak - held) / params,
    }
    del model, inner, outer, tokens
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def outer(rank: int, world_size: int, settings: dict) -> dict:
    """Per size (largest first) and method: `outer_step`'s row, or the error that stopped it (an
    out-of-memory at the largest size is a result: the row says so and the next size runs)."""
    import traceback

    device = torch.device("cuda", 0) if settings["cuda"] else torch.device("cpu")
    result = {"settings": dict(settings), "rows": [], "errors": []}
    for size in settings["sizes"]:
        for method in settings["methods"]:
            try:
                row = outer_step(size, method, settings, device)
            except Exception:  # noqa: BLE001 — each measurement is independent; the error is the result
                result["errors"].append({"model": size, "method": method, "error": traceback.format_exc(limit=6)})
                print(f"outer {size} {method}: failed\n{result['errors'][-1]['error']}", flush=True)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            print("outer", {k: v for k, v in row.items() if not k.endswith("_all")}, flush=True)
            result["rows"].append(row)
    return result
