"""The collectives one training step of each method issues on `edgc bench` / `edgc train` (pure DP).

A step's DP sync is one or more blocking collectives per DDP bucket; each costs a fixed latency
besides its bytes, and a token-bucket link lets a message of up to its burst through at once. So the
cost model needs the collectives and their sizes, not only the step's total bytes:

* DDP buckets (torch's rule): the gradients in ready order (the reverse of the HF GPT-2 parameter
  order), packed greedily until a bucket holds at least its cap; the first bucket's cap is 1 MiB
  with DDP's default 25 MiB cap (torch ``_DEFAULT_FIRST_BUCKET_BYTES``), the cap itself when one is
  given. ``torch-powersgd`` runs with ``bucket_cap_mb=500`` (edgc_train.compressors), one bucket.
* per bucket, ``none`` (DDP's native all-reduce; in older bench folders, without a `nosync` run, our blocking
  hook), ``allreduce`` (our non-blocking hook) and the registered sync methods (`edgc.sync.sync_methods`):
  one collective, the all-gather or all-reduce the method's entry names (top-k and QSGD gather,
  fp16/bf16 and random-k all-reduce); ``allreduce-blocking``: one all-reduce of all gradients packed, after backward;
  ``nosync``: none at all;
  ``powersgd`` / ``edgc`` (our engine, edgc/engine/lowrank.py) and ``torch-powersgd`` (PyTorch's hook)
  once compressing: three all-reduces, the raw (uncompressed) tensors, the packed Ps, the packed Qs
  (our engine issues only the raw one for a bucket without a compressible matrix); EDGC adds an
  all-reduce and a broadcast of a few bytes at each decision step, which only a measured count sees.

`edgc train` logs the measured count per step (``collectives`` in metrics.jsonl); this module is
the fallback for runs without it and gives every collective its payload.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from edgc.engine.factors import compressed_rank as engine_rank
from edgc.sync.sync_methods import ALL_GATHER, sync_method

from .presets import ModelSpec

MIB = 2**20
DDP_BUCKET_CAP_MIB = 25  # DistributedDataParallel's default bucket_cap_mb
DDP_FIRST_BUCKET_MIB = 1  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES (default cap only)
BUCKET_CAP_MIB = {"torch-powersgd": 500}  # edgc_train.compressors.ddp_kwargs
LOW_RANK = ("powersgd", "edgc", "torch-powersgd")
NO_SYNC = ("nosync",)  # the compute floor: no collectives
ONE_PACKED = ("allreduce-blocking",)  # one all-reduce of every gradient, after backward


def issues_all_gather(compressor: str) -> bool:
    """Whether each call of ``compressor`` is an all-gather (every rank receives every other rank's
    message) rather than an all-reduce: what its entry in the library's registry says."""
    method = sync_method(compressor)
    return method is not None and method.collective == ALL_GATHER


def gpt2_gradient_shapes(model: ModelSpec) -> list:
    """Shapes of HF GPT2LMHeadModel's parameters in definition order (the LM head is tied to wte;
    Conv1D weights are stored (in, out))."""
    h = model.hidden
    shapes = [(model.vocab, h), (model.position_count, h)]
    for _ in range(model.layers):
        shapes += [(h,), (h,), (h, 3 * h), (3 * h,), (h, h), (h,), (h,), (h,), (h, 4 * h), (4 * h,), (4 * h, h), (h,)]
    return shapes + [(h,), (h,)]


def ddp_buckets(shapes: Sequence[tuple], cap_mib: float | None = None, bytes_per_value: int = 4) -> list:
    """DDP's buckets after its rebuild: lists of gradient shapes in ready order (reverse definition
    order), greedily filled until each reaches its size limit."""
    if cap_mib is None:
        limits = [DDP_FIRST_BUCKET_MIB * MIB, DDP_BUCKET_CAP_MIB * MIB]
    else:
        limits = [cap_mib * MIB]
    buckets, current, size = [], [], 0
    for shape in reversed(list(shapes)):
        current.append(shape)
        size += math.prod(shape) * bytes_per_value
        if size >= limits[min(len(buckets), len(limits) - 1)]:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def compressed_rank(shape: tuple, rank: int, min_compression_rate: float = 2.0) -> int:
    """The rank a gradient of this shape is sent at, 0 = raw: the engine's rule (`edgc.engine.lowrank`) on
    the tensor viewed as shape[0] x rest, which is also torch's hook's rule."""
    if len(shape) < 2 or math.prod(shape) == 0:
        return 0
    return engine_rank((shape[0], math.prod(shape) // shape[0]), rank, min_compression_rate)


def bucket_collectives(
    compressor: str, model: ModelSpec, rank: int | None, bytes_per_value: int = 4, min_compression_rate: float = 2.0
) -> list:
    """Per DDP bucket in ready order, the payloads in bytes of the collectives it issues (rank None:
    uncompressed); ``allreduce-blocking`` is one group (its single packed all-reduce), ``nosync`` none.

    For the low-rank methods the payloads follow from the shapes (raw tensors, P = m x r, Q = n x r
    per compressed matrix; our engine adds one flag value to the raw message); for the others
    each bucket's collective carries that bucket's share of the step's values (multiply by the
    method's bytes per value, e.g. via `scale_to`)."""
    if compressor in NO_SYNC:
        return []
    shapes = gpt2_gradient_shapes(model)
    if compressor in ONE_PACKED:
        return [[sum(math.prod(s) for s in shapes) * bytes_per_value]]
    buckets = ddp_buckets(shapes, BUCKET_CAP_MIB.get(compressor), bytes_per_value)
    out = []
    for bucket in buckets:
        values = sum(math.prod(s) for s in bucket)
        if compressor not in LOW_RANK or not rank:
            out.append([values * bytes_per_value])
            continue
        ranks = [compressed_rank(s, rank, min_compression_rate) for s in bucket]
        raw = sum(math.prod(s) for s, r in zip(bucket, ranks) if not r)
        p = sum(s[0] * r for s, r in zip(bucket, ranks) if r)
        q = sum(math.prod(s) // s[0] * r for s, r in zip(bucket, ranks) if r)
        if compressor == "torch-powersgd":
            out.append([raw * bytes_per_value, p * bytes_per_value, q * bytes_per_value])
        elif p:
            out.append([(raw + 1) * bytes_per_value, p * bytes_per_value, q * bytes_per_value])
        else:
            out.append([(raw + 1) * bytes_per_value])
    return out


def bucket_values(compressor: str, model: ModelSpec, bytes_per_value: int = 4) -> list:
    """Gradient values of each group of `bucket_collectives` (how far backward is when it is ready)."""
    if compressor in NO_SYNC:
        return []
    shapes = gpt2_gradient_shapes(model)
    if compressor in ONE_PACKED:
        return [sum(math.prod(s) for s in shapes)]
    return [sum(math.prod(s) for s in b) for b in ddp_buckets(shapes, BUCKET_CAP_MIB.get(compressor), bytes_per_value)]


def step_collectives(
    compressor: str, model: ModelSpec, rank: int | None, bytes_per_value: int = 4, min_compression_rate: float = 2.0
) -> list:
    """Payload in bytes of every collective one step issues, in order (`bucket_collectives` flattened)."""
    return [
        p for group in bucket_collectives(compressor, model, rank, bytes_per_value, min_compression_rate) for p in group
    ]


def scale_to(payloads: Sequence[float], total: float) -> list:
    """The payloads rescaled so that they add up to `total` (a run's measured bytes per step)."""
    s = sum(payloads)
    return [p * total / s for p in payloads] if s > 0 else list(payloads)
