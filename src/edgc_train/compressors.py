"""One DDP communication hook + state per compressor name, behind one small interface.

==================  ==========================================================================
name                what runs in DDP's gradient synchronisation
==================  ==========================================================================
``none``            DDP with no hook: its native all-reduce, overlapped with backward (what users
                    run today; every ratio is against it)
``allreduce``       ``edgc.edgc_hook`` with ``edgc.AllReduceState``: the same averaged all-reduce through
                    our non-blocking hook machinery, with our metrics
``allreduce-blocking`` the paper's (Megatron-style) sync: an all-reduce of all gradients *after*
                    backward, nothing overlapped (a labelled comparison, not a baseline)
``nosync``          no gradient sync at all: the compute floor (replicas drift apart; time only)
``powersgd``        ``edgc.edgc_hook`` with ``EDGCConfig.static(rank)``: PowerSGD at a fixed rank
                    after the warm-up, through our engine (error feedback, warm-started Q)
``torch-powersgd``  PyTorch's built-in ``powerSGD_hook`` / ``PowerSGDState`` (rank
                    ``powersgd_rank``, compression from the same warm-up step as ours)
``edgc``            ``edgc.edgc_hook``: entropy-driven dynamic rank
``fp16``, ``bf16``  ``edgc.CastState``: all-reduce of the gradients cast to 16 bits
``topk``            ``edgc.TopKState``: top ``compress_ratio`` of entries, values+indices all-gather, EF
``randomk``         ``edgc.RandomKState``: ``compress_ratio`` of entries at shared random indices, EF
``qsgd8``           ``edgc.QSGDState``: 8-bit stochastic quantisation (chunked max-abs), all-gather, EF
==================  ==========================================================================

The baselines (``fp16`` … ``qsgd8``, and any other sync method registered in `edgc.sync.sync_methods`)
compress from the first step (no warm-up) and run through the same ``edgc_hook`` as EDGC (their
collectives are blocking inside it), with the same metrics.

Every handle reports, after each optimizer step, the fields of a ``metrics.jsonl`` train line that
come from the synchronisation: phase, rank, ranks, entropy, elements/bytes sent vs raw, and the
communication and compression times (see ``Compressor.step_metrics``).

Why ``torch-powersgd`` forces ``bucket_cap_mb=500``: its P and Q all-reduces are issued from future
callbacks, so with several buckets in flight the ranks can issue them in different orders, and gloo
(which matches collectives by issue order) aborts with a "collective mismatch". One
bucket means one chain of collectives per step, which is safe on every backend.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from edgc.sync.sync_methods import sync_method

from .config import scaled_edgc_defaults

TORCH_POWERSGD_COLLECTIVES = 3  # per bucket once compressing (powerSGD_hook: uncompressed, P, Q)
METRIC_KEYS = (
    "phase",
    "rank",
    "ranks",
    "entropy",
    "elements_sent",
    "elements_raw",
    "bytes_sent",
    "bytes_raw",
    "compress_time_s",
    "comm_time_s",
    "comm_wait_s",
    "collectives",
    "collective_s",
    "relative_error",
    "entropy_time_s",
    "rank_budget",
    "mean_rank",
    "decision",
)


def ddp_kwargs(name: str) -> dict[str, Any]:
    """Extra ``DistributedDataParallel`` arguments a compressor needs (decided before DDP is built)."""
    return {"bucket_cap_mb": 500} if name == "torch-powersgd" else {}


class Compressor:
    """A registered hook: ``step_metrics()`` after each optimizer step; state for checkpoints."""

    name: str

    def step_metrics(self) -> dict[str, Any]:
        raise NotImplementedError

    def state_dict(self) -> Any:
        raise NotImplementedError

    def load_state_dict(self, sd: Any) -> None:
        raise NotImplementedError

    def after_backward(self) -> None:
        """Called once per optimizer step after the last backward (only a sync-after-backward acts)."""


def _skip_sync_hook(state, bucket):  # unannotated: DDP checks annotations
    """A DDP hook that communicates nothing: the bucket's local gradients are its result."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class Uncompressed(Compressor):
    """``none`` (DDP's own all-reduce), ``nosync`` and ``allreduce-blocking``.

    DDP's native all-reduce runs in C++ and overlaps backward: its time is not separable, so
    comm and compress times are None. Bytes are the full gradient (0 for ``nosync``)."""

    def __init__(self, name: str, ddp_model):
        import edgc

        self.name = name
        params = [p for p in ddp_model.module.parameters() if p.requires_grad]
        self.elements = sum(p.numel() for p in params)
        self.size = self.elements * (params[0].element_size() if params else 4)
        self.state = None
        if name != "none":
            ddp_model.register_comm_hook(None, _skip_sync_hook)
        if name == "allreduce-blocking":
            self.state = edgc.AllReduceState(process_group=None, model=ddp_model)
            self._module = ddp_model.module

    def after_backward(self) -> None:
        if self.state is not None:
            self.state.synchronize(self._module.named_parameters())

    def step_metrics(self) -> dict[str, Any]:
        if self.state is not None:
            m = self.state.last_step_metrics
            return {k: m.get(k) for k in METRIC_KEYS}
        sent = 0 if self.name == "nosync" else self.elements
        return {
            "phase": "off",
            "rank": None,
            "ranks": {},
            "entropy": None,
            "elements_sent": sent,
            "elements_raw": self.elements,
            "bytes_sent": sent * self.size // max(1, self.elements),
            "bytes_raw": self.size,
            "compress_time_s": None,
            "comm_time_s": None,
            "collectives": None,
            "collective_s": None,
            "relative_error": None,
            "entropy_time_s": None,
        }

    def state_dict(self) -> Any:
        return {"format": f"{self.name}/1"}

    def load_state_dict(self, sd: Any) -> None:
        if not isinstance(sd, dict) or sd.get("format") != f"{self.name}/1":
            raise ValueError(f"not a {self.name} compressor state")


class EngineCompressor(Compressor):
    """``allreduce``, ``powersgd``, ``edgc`` and the registered sync methods: our states report per-step
    metrics. ``config``: the EDGCConfig of ``powersgd`` / ``edgc``, the TrainConfig of a sync method."""

    def __init__(self, name: str, ddp_model, config):
        import edgc

        self.name = name
        if name == "allreduce":
            self.state = edgc.AllReduceState(process_group=None, model=ddp_model)
        elif (method := sync_method(name)) is not None:
            self.state = method.build(model=ddp_model, ratio=config.compress_ratio, seed=config.seed)
        else:
            self.state = edgc.EDGCState(process_group=None, config=config, model=ddp_model)
        ddp_model.register_comm_hook(self.state, edgc.edgc_hook)

    def step_metrics(self) -> dict[str, Any]:
        m = self.state.last_step_metrics or {}
        return {k: m.get(k) for k in METRIC_KEYS}

    def state_dict(self) -> Any:
        return self.state.state_dict()

    def load_state_dict(self, sd: Any) -> None:
        self.state.load_state_dict(sd)


class TorchPowerSGD(Compressor):
    """PyTorch's ``powerSGD_hook``, wrapped to measure it the way our engine measures itself.

    Time: from the hook call until the future it returns has completed (its compression and both
    all-reduces run inside that span, chained by callbacks), summed over buckets and reported as
    ``comm_time_s``; ``compress_time_s`` is 0 because the two cannot be separated from outside.
    Volume: recomputed from the bucket with the hook's own rule (a tensor of ≥ 2 dims viewed as
    n × m is sent as P and Q, (n + m)·r elements, when n·m > (n + m)·r·min_compression_rate;
    everything else is all-reduced raw), or everything raw before ``start_powerSGD_iter``.
    """

    name = "torch-powersgd"

    def __init__(self, ddp_model, rank: int, start_iter: int, seed: int):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        self._psgd = psgd
        # start_powerSGD_iter ≥ 2: DDP rebuilds its buckets after iteration 0, and the state is keyed
        # by bucket index, so compression must not begin before that (torch asserts the same).
        self.state = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=max(2, start_iter), random_seed=seed
        )
        self._names = {id(p): n for n, p in ddp_model.module.named_parameters()}
        self._layouts: dict[int, list[tuple[str, tuple[int, ...]]]] = {}  # bucket -> (name, shape) in order
        self._reset()
        ddp_model.register_comm_hook(self, TorchPowerSGD._hook)

    def _reset(self) -> None:
        self._acc = {
            "collective_s": [],
            "collectives": 0,
            "elements_sent": 0,
            "elements_raw": 0,
            "bytes_sent": 0,
            "bytes_raw": 0,
            "ranks": {},
        }

    def _compressed(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(n, m, k) when the hook sends this gradient as rank-k factors, else None (its rule exactly)."""
        n = shape[0]
        m = math.prod(shape) // n
        k = min(n, m, self.state.matrix_approximation_rank)
        return (n, m, k) if (n + m) * k * self.state.min_compression_rate < n * m else None

    def _segments(self, layout: list[tuple[str, tuple[int, ...]]]) -> dict[str, list[tuple[str, int]]]:
        """How the hook's bucket-indexed buffers are laid out for a bucket holding ``layout`` in order.

        error: one slice per parameter, in bucket order (it mirrors the bucket buffer). P and Q: one
        slice per compressed parameter, grouped by matrix shape in order of first appearance, then
        bucket order (``powerSGD_hook`` batches by shape the same way).
        """
        by_shape: dict[tuple[int, int], list[tuple[str, int, int, int]]] = {}
        for name, shape in layout:
            if (nmk := self._compressed(shape)) is not None:
                by_shape.setdefault(nmk[:2], []).append((name, *nmk))
        ordered = [entry for group in by_shape.values() for entry in group]
        return {
            "error": [(name, math.prod(shape)) for name, shape in layout],
            "p": [(name, n * k) for name, n, m, k in ordered],
            "q": [(name, m * k) for name, n, m, k in ordered],
        }

    def _relayout(self, index: int, old: list, new: list) -> None:
        """Permute the state of bucket ``index`` from parameter order ``old`` to ``new``.

        DDP builds its first buckets in reverse parameter order and rebuilds them in gradient-ready
        order after the first iteration, so a fresh DDP (after a resume) presents the parameters in
        another order than the one the saved error-feedback and P/Q buffers were written in.
        """
        if sorted(old) != sorted(new):
            raise RuntimeError("torch-powersgd: DDP moved parameters between buckets; its state cannot be remapped")
        old_seg, new_seg = self._segments(old), self._segments(new)
        for kind, memory in (
            ("error", self.state.error_dict),
            ("p", self.state.p_memory_dict),
            ("q", self.state.q_memory_dict),
        ):
            if index not in memory:
                continue
            buf, pieces, offset = memory[index], {}, 0
            for name, size in old_seg[kind]:
                pieces[name] = buf[offset : offset + size]
                offset += size
            memory[index] = torch.cat([pieces[name] for name, _ in new_seg[kind]]) if pieces else buf

    @staticmethod
    def _hook(self, bucket):  # unannotated: DDP checks annotations and ours would be strings
        st, acc = self.state, self._acc
        layout = [
            (self._names.get(id(p), str(id(p))), tuple(g.shape))
            for p, g in zip(bucket.parameters(), bucket.gradients())
        ]
        index = bucket.index()
        if index in self._layouts and self._layouts[index] != layout:
            self._relayout(index, self._layouts[index], layout)
        self._layouts[index] = layout
        compressing = st.iter >= st.start_powerSGD_iter
        # the hook's pattern: one all-reduce of the bucket before start_powerSGD_iter, then three
        # (the uncompressed tensors, the packed Ps, the packed Qs; issued even when one is empty)
        acc["collectives"] += TORCH_POWERSGD_COLLECTIVES if compressing else 1
        for (name, shape), g in zip(layout, bucket.gradients()):
            raw = sent = g.numel()
            if compressing and (nmk := self._compressed(shape)) is not None:
                n, m, k = nmk
                sent = (n + m) * k
                acc["ranks"][name] = k
            acc["elements_raw"] += raw
            acc["elements_sent"] += sent
            acc["bytes_raw"] += raw * g.element_size()
            acc["bytes_sent"] += sent * g.element_size()
        t0 = time.perf_counter()
        fut = self._psgd.powerSGD_hook(st, bucket)

        def done(f):
            # its collectives are chained inside the hook: one span per bucket
            acc["collective_s"].append(time.perf_counter() - t0)
            return f.value()

        return fut.then(done)

    def step_metrics(self) -> dict[str, Any]:
        acc = self._acc
        compressed = bool(acc["ranks"])
        out = {
            "phase": "compress" if compressed else "warmup",
            "rank": self.state.matrix_approximation_rank if compressed else None,
            "ranks": acc["ranks"],
            "entropy": None,
            "compress_time_s": 0.0,
            "relative_error": None,
        }
        out.update(
            {
                k: acc[k]
                for k in ("elements_sent", "elements_raw", "bytes_sent", "bytes_raw", "collectives", "collective_s")
            }
        )
        out["comm_time_s"] = sum(acc["collective_s"])
        self._reset()
        return out

    def state_dict(self) -> Any:
        # Every PowerSGDState slot but the process group (error feedback, P/Q memories, RNG, iter),
        # plus the parameter order those bucket-indexed buffers are in.
        slots = {slot: getattr(self.state, slot) for slot in self.state.__slots__ if slot != "process_group"}
        return {"format": "torch-powersgd/1", "slots": slots, "layouts": self._layouts}

    def load_state_dict(self, sd: Any) -> None:
        if not isinstance(sd, dict) or sd.get("format") != "torch-powersgd/1":
            raise ValueError("not a torch-powersgd compressor state")
        for slot, value in sd["slots"].items():
            setattr(self.state, slot, value)
        self._layouts = sd["layouts"]


def build(name: str, ddp_model, config) -> Compressor:
    """Register compressor ``name`` on ``ddp_model``; ``config`` is the TrainConfig."""
    if sync_method(name) is not None:
        return EngineCompressor(name, ddp_model, config)
    if name in ("none", "nosync", "allreduce-blocking"):
        return Uncompressed(name, ddp_model)
    if name in ("allreduce", "powersgd", "edgc"):
        return EngineCompressor(name, ddp_model, config.edgc_config)
    if name == "torch-powersgd":
        # Same uncompressed warm-up as our engine's default: ⌊0.1 · steps⌋ (at least 2, see above).
        start = math.floor(scaled_edgc_defaults(config.steps)["warmup_fraction"] * config.steps)
        return TorchPowerSGD(ddp_model, config.powersgd_rank, start, config.seed)
    raise ValueError(f"compressor: unknown {name!r}")
