"""Part "outer" of the GPU run: one DiLoCo outer step at GPT-2 XL and at the largest model that fits.

DiLoCo (`edgc.integrations.diloco.DiLoCo`) on a process group of one (NCCL on the GPU), a GPT-2 with
fp32 parameters and AdamW as the inner optimizer, θ_global kept in pinned host memory as DiLoCo
keeps it. The outer step runs inside the inner optimizer's ``step()`` that ends each ``sync_every``
inner steps; its cost is that call's time minus a plain inner ``step()``'s, and its memory the peak
during that call beyond what the process held just before it (parameters, gradients, AdamW's
moments and DiLoCo's error feedback from the outer step before: the training state). Both are taken
at the second outer step, when the error feedback exists; a third outer step is counted
(`edgc_probes.dispatch_count.DispatchCounter`: the dispatches that launch device work).

After the listed sizes (XL first), the largest model that fits: the widest of `BEYOND_XL` whose
training state and outer step, at the bytes per parameter XL took, fit in 90 % of the device's
memory, and the next smaller ones if it runs out of memory (a result too: the row says so).
"""

from __future__ import annotations

import gc

import torch

from .gpu_support import DeviceTimer, gpt2, memory_allocated, peak_memory, vocabulary

SYNC_EVERY = 2
OUTER_STEPS = 2  # the second is timed: its error feedback was made by the first; a third is counted
# GPT-2's shape grown past XL: (layers, width, heads, vocabulary, context); about 2.7, 4.2 and 6.7 billion.
BEYOND_XL = {
    "6.7b": (32, 4096, 32, 50257, 1024),
    "4.2b": (36, 3072, 24, 50257, 1024),
    "2.7b": (32, 2560, 32, 50257, 1024),
}
FITS = 0.9  # the share of the device's memory a model's predicted peak may take


def _inner_step(model, inner, tokens, timer: DeviceTimer, counter=None) -> tuple:
    """forward, backward, then the inner optimizer's step marked on its own (inside ``counter``, a
    dispatch counter, if given): (start, end) marks around ``inner.step()`` and the memory held just
    before it."""
    model(input_ids=tokens, labels=tokens).loss.backward()
    held = memory_allocated(tokens.device)
    peak_memory(tokens.device, reset=True)
    start = timer.mark()
    if counter is None:
        inner.step()
    else:
        with counter:
            inner.step()
    end = timer.mark()
    inner.zero_grad(set_to_none=False)
    return start, end, held, peak_memory(tokens.device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def outer_step(size: str, method: str, settings: dict, device: torch.device) -> dict:
    """One measured outer step of DiLoCo with the outer sync ``method`` on GPT-2 ``size``."""
    from edgc.integrations.diloco import DiLoCo
    from edgc_probes.dispatch_count import DispatchCounter

    torch.manual_seed(0)
    model = gpt2(size, device, dtype=torch.float32, shapes=BEYOND_XL)
    params = sum(p.numel() for p in model.parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    tokens = torch.randint(0, vocabulary(size, BEYOND_XL), (settings["micro_batch"], settings["seq_len"])).to(device)
    timer, marks, counter = DeviceTimer(device), [], DispatchCounter()
    with DiLoCo(None, [model], inner, outer, SYNC_EVERY, sync_method=method):
        for _ in range(SYNC_EVERY * OUTER_STEPS):
            marks.append(_inner_step(model, inner, tokens, timer))
        for k in range(SYNC_EVERY):  # the third outer step, counted
            _inner_step(model, inner, tokens, timer, counter if k == SYNC_EVERY - 1 else None)
    timer.synchronize()
    seconds = [timer.seconds(start, end) for start, end, _, _ in marks]
    plain = [s for k, s in enumerate(seconds) if (k + 1) % SYNC_EVERY]  # inner steps with no outer step
    start, end, held, peak = marks[-1]
    top = sorted(counter.by_op.items(), key=lambda item: -item[1])[:8]
    row = {
        "model": size,
        "method": method,
        "params": params,
        "sync_every": SYNC_EVERY,
        "inner_step_s": min(plain),
        "outer_step_s": seconds[-1] - min(plain),
        "outer_step_s_all": [s for k, s in enumerate(seconds) if not (k + 1) % SYNC_EVERY],
        "dispatches": counter.total,
        "dispatches_top": dict(top),
        "held_bytes": held,
        "peak_beyond_held_bytes": None if held is None else peak - held,
        "peak_beyond_held_bytes_per_param": None if held is None else (peak - held) / params,
        "peak_bytes_per_param": None if peak is None else peak / params,
    }
    del model, inner, outer, tokens
    _release(device)
    return row


def params_of(size: str) -> int:
    """Parameters of GPT-2 ``size`` (or of a `BEYOND_XL` shape), from its shapes alone."""
    from edgc_probes.gpt2_layout import GPT2_SIZES

    layers, width, _, vocab, context = {**GPT2_SIZES, **BEYOND_XL}[size]
    return layers * (12 * width * width + 13 * width) + (vocab + context + 2) * width


def beyond_xl(rows: list[dict], device_bytes: int | None) -> list[str]:
    """The `BEYOND_XL` sizes to try, widest first: those whose peak, at the most bytes per parameter
    a measured row took, fits in `FITS` of ``device_bytes``."""
    per_param = max((row["peak_bytes_per_param"] or 0 for row in rows), default=0)
    if not per_param or not device_bytes:
        return []
    return [size for size in BEYOND_XL if params_of(size) * per_param <= FITS * device_bytes]


def outer_part(record, settings: dict) -> None:
    """Per size of ``settings["sizes"]`` (XL first) and method: `outer_step`'s row; then the largest
    model that fits (`beyond_xl`), stopping at the first that runs."""
    device = torch.device("cuda", 0) if settings["cuda"] else torch.device("cpu")
    for size in settings["sizes"]:
        for method in settings["methods"]:
            record.attempt(
                "rows", {"model": size, "method": method}, lambda: outer_step(size, method, settings, device)
            )
            _release(device)
    if not settings.get("largest"):
        return
    total = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else None
    tries = beyond_xl(record.data.get("rows", []), total)
    record.set("largest_tried", tries)
    method = settings["methods"][0]
    for size in tries:
        row = record.attempt(
            "rows",
            {"model": size, "method": method, "largest": True},
            lambda: outer_step(size, method, settings, device),
        )
        _release(device)
        if row is not None:
            return
        failure = record.data["errors"][-1]["error"]
        if "out of memory" not in failure.lower():
            return  # not a question of size: a smaller model would fail alike
    if not tries:
        record.set("largest_note", "no size beyond XL was predicted to fit (or no device memory to predict with)")
