"""Baseline gradient compressors, each a `GradientReducer` (same hook, metrics and checkpoints as EDGC).

==============  =============================================================================  ==============
state           what one call (a DDP bucket, or all gradients on the plain-loop path) sends     bytes per rank
==============  =============================================================================  ==============
`CastState`     the packed gradients cast to fp16 / bf16, one all-reduce (mean)                 2·N
`TopKState`     the k = ⌈ratio·N⌉ largest-magnitude entries of G + e: values (fp32) and          8·k
                indices (int32, bit-cast into the same fp32 buffer), one all-gather; EF
`RandomKState`  k entries at indices drawn from a generator seeded by (seed, step, call):       4·k
                the same indices on every rank, so the values go in one all-reduce; EF
`QSGDState`     G + e stochastically rounded to int8 (levels −127…127) with one fp32 scale     N + 4·⌈N/c⌉
                (max-abs) per chunk of c elements, one all-gather of int8; the rounding
                noise is this rank's own, seeded by (seed, rank, step, call); EF
==============  =============================================================================  ==============

N = elements in the call, ratio = ``ratio``, c = ``chunk``. "Bytes per rank" is what this rank puts
on the wire for that call (``bytes_sent``); all-gathered payloads reach every other rank.

Error feedback (EF, ``error_feedback=True``): e ← (G + e) − C(G + e), the part of this rank's
corrected gradient that its compressed message did not carry; it is added to the next step's
gradient, so mean over ranks of (decompressed + e) equals mean of (G + e): nothing is lost, only
delayed. It is stored per parameter name, so checkpoints survive a different DDP bucket layout.

Unbiasedness: `RandomKState` with ``rescale=True`` (the default without EF) multiplies the kept
values by 1/P(index drawn), and `QSGDState`'s stochastic rounding is unbiased per element, so
E[decompressed] = input for both. `TopKState` is biased (and relies on EF); `CastState` rounds to
nearest (deterministic, relative error ≤ 2⁻¹¹ for fp16, 2⁻⁸ for bf16).

Collectives are blocking and issued in a fixed order by `Communicator` (see comm.py), never from
future callbacks, so any number of DDP buckets is safe under gloo.

Fit for a GPU: random numbers are drawn on the gradients' device, from generators seeded per call
(a resumed run draws the same ones, with no generator state to save); errors stay device values,
read once at the end of the step; and every rank turns the gathered messages into the average in
the same order of additions, whatever runs in parallel on the device, so replicas stay identical.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..runner.reducer import GradientReducer
from ..runner.seeds import stable_seed
from ..runner.stats import ReduceStats
from .error_feedback import BASELINE_FORMAT, COMPRESSED, ErrorFeedbackReducer, check_format
from .error_feedback import unpack as _unpack

CAST_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _pack(grads: list[torch.Tensor], flat: torch.Tensor | None) -> torch.Tensor:
    return flat if flat is not None else torch.cat([g.reshape(-1) for g in grads])


class CastState(GradientReducer):
    """Averaged all-reduce of the gradients cast to fp16 or bf16 (no error feedback).

    Args:
        process_group: as `GradientReducer`'s: the group it averages over.
        dtype: the wire's, ``"float16"`` or ``"bfloat16"`` (or the torch dtype).
        model: as `GradientReducer`'s: the module whose parameters it names.

    Raises:
        ValueError: another dtype.
    """

    method = "cast"

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        dtype: str | torch.dtype = "float16",
        model: nn.Module | None = None,
    ):
        super().__init__(process_group, model=model)
        if isinstance(dtype, str):
            if dtype not in CAST_DTYPES:
                raise ValueError(f"dtype: must be one of {', '.join(CAST_DTYPES)}, got {dtype!r}")
            dtype = CAST_DTYPES[dtype]
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype: must be float16 or bfloat16, got {dtype}")
        self.dtype = dtype

    def agreed_settings(self, device: torch.device) -> dict[str, Any]:
        """`GradientReducer.agreed_settings` and the wire's dtype.

        Args:
            device: the gradients'.

        Returns:
            Name → value of every setting compared.
        """
        return {**super().agreed_settings(device), "CastState.dtype": str(self.dtype)}

    def _reduce(self, names, grads, flat) -> None:
        packed = _pack(grads, flat)
        on_wire = packed.to(self.dtype)
        self.comm.mean_(on_wire)  # divides before summing, so fp16 cannot overflow in the sum
        packed.copy_(on_wire)
        _unpack(packed, grads, flat)
        n = packed.numel()
        self._add_stats(
            ReduceStats(n, n, n * packed.element_size(), n * on_wire.element_size(), ranks={name: 0 for name in names})
        )

    def _settle_step(self, record, totals) -> dict:
        return dict(COMPRESSED)

    def state_dict(self) -> dict:
        """`GradientReducer.state_dict`, marked with the method's name.

        Returns:
            The state, for `load_state_dict`.
        """
        return {"format": BASELINE_FORMAT, "method": self.method, **super().state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned.

        Args:
            state: a `CastState`'s state.

        Raises:
            ValueError: another method's state.
        """
        check_format(state, self.method)
        super().load_state_dict(state)


def _keep(n: int, ratio: float) -> int:
    return max(1, min(n, math.ceil(ratio * n)))


def _check_ratio(ratio: float) -> float:
    if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
        raise ValueError(f"ratio: must be in (0, 1], got {ratio!r}")
    return float(ratio)


def exact_topk_indices(magnitude: torch.Tensor, k: int, sample: int = 100_000) -> torch.Tensor:
    """Indices of the k largest entries, exactly as ``topk`` finds them, but fast on big CPU tensors.

    ``torch.topk`` with k ~ 1% of 10⁷ entries takes seconds on one CPU thread. A threshold from a
    strided sample (about 2k expected survivors) keeps a small candidate set that contains every
    entry ≥ the threshold; when it holds at least k entries, the k largest of it are the k largest
    overall. Otherwise (rare) the full ``topk`` runs. On other devices ``topk`` runs at once: the
    candidate set's size is known only on the device, and reading it would synchronise the host.
    """
    n = magnitude.numel()
    if magnitude.device.type != "cpu" or n <= 4 * sample or 4 * k > n:
        return magnitude.topk(k, sorted=False).indices
    probe = magnitude[:: n // sample]
    survivors = max(1, min(probe.numel(), math.ceil(2 * k / n * probe.numel())))
    threshold = probe.topk(survivors, sorted=False).values.min()
    candidates = (magnitude >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return magnitude.topk(k, sorted=False).indices
    return candidates[magnitude[candidates].topk(k, sorted=False).indices]


def seeded_generator(device: torch.device | str, *seed_parts: object) -> torch.Generator:
    """A generator on ``device`` seeded by ``seed_parts`` (the same seed in every process)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(stable_seed(*seed_parts))
    return generator


def first_of_runs(ordered: torch.Tensor) -> torch.Tensor:
    """For each position of a sorted vector, the position where its run of equal values begins."""
    positions = torch.arange(ordered.numel(), device=ordered.device)
    begins = torch.ones_like(ordered, dtype=torch.bool)
    begins[1:] = ordered[1:] != ordered[:-1]
    return torch.where(begins, positions, 0).cummax(0).values


class TopKState(ErrorFeedbackReducer):
    """Global top-k by magnitude per call; values + int32 indices in one all-gather; error feedback.

    Args:
        process_group: as `GradientReducer`'s.
        ratio: the share of entries sent, in (0, 1].
        error_feedback: keep what was not sent for the next step.
        model: as `GradientReducer`'s.
    """

    method = "topk"
    ARGUMENTS = ("ratio",)

    def __init__(self, process_group=None, *, ratio: float = 0.01, error_feedback: bool = True, model=None):
        super().__init__(process_group, error_feedback=error_feedback, model=model)
        self.ratio = _check_ratio(ratio)

    def _reduce(self, names, grads, flat) -> None:
        corrected = self._corrected(names, grads)
        n = corrected.numel()
        if n >= 2**31:
            raise ValueError("topk: a call holds ≥ 2^31 elements; int32 indices cannot address it")
        k = _keep(n, self.ratio)
        indices = exact_topk_indices(corrected.abs(), k)
        values = corrected[indices]
        # One message: k fp32 values, then the k int32 indices bit-cast to fp32 (no conversion).
        message = torch.cat([values.float(), indices.to(torch.int32).view(torch.float32)])
        sent_local = torch.zeros_like(corrected)
        sent_local[indices] = values
        average = torch.zeros_like(corrected)
        # One rank's k indices are distinct, so no two additions of one part meet on an element, and
        # parts are added one after the other in rank order: each element's sum has one order on
        # every rank and device (atomic or not), and replicas stay bit-identical.
        for part in self.comm.all_gather(message):
            average.index_add_(0, part[k:].view(torch.int32), part[:k].to(average.dtype))
        average.div_(self.comm.world_size)
        self._finish(names, grads, flat, corrected, sent_local, average, 2 * k, message.numel() * 4)


class RandomKState(ErrorFeedbackReducer):
    """k entries at shared random indices (same on every rank, no index traffic), one all-reduce.

    Indices are k draws with replacement from a generator on the gradients' device seeded by
    (seed, step, call), so a resumed run draws the same ones. ``rescale`` (default: on without
    error feedback) divides the kept values by P(an index is drawn) = 1 − (1 − 1/N)^k, which
    makes the result unbiased.

    Args:
        process_group: as `GradientReducer`'s.
        ratio: the share of entries drawn, in (0, 1].
        error_feedback: keep what was not sent.
        rescale: divide the kept values by P(an index is drawn); None: on without error feedback.
        seed: of the draws.
        model: as `GradientReducer`'s.
    """

    method = "randomk"
    ARGUMENTS = ("ratio", "rescale", "seed")

    def __init__(
        self,
        process_group=None,
        *,
        ratio: float = 0.01,
        error_feedback: bool = True,
        rescale: bool | None = None,
        seed: int = 714,
        model=None,
    ):
        super().__init__(process_group, error_feedback=error_feedback, model=model)
        self.ratio = _check_ratio(ratio)
        self.rescale = (not error_feedback) if rescale is None else bool(rescale)
        self.seed = int(seed)

    def indices(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """This call's k draws from range(n), seeded by (seed, step, call).

        Args:
            n: the entries drawn from.
            device: where the draws are made and kept.

        Returns:
            The k indices, sorted (so that repeats sit side by side).
        """
        generator = seeded_generator(device, self.seed, "randomk", self.step, self._call)
        return torch.randint(0, n, (_keep(n, self.ratio),), generator=generator, device=device).sort().values

    def _reduce(self, names, grads, flat) -> None:
        corrected = self._corrected(names, grads)
        n = corrected.numel()
        indices = self.indices(n, corrected.device)
        k = indices.numel()
        values = corrected[indices]
        sent_local = torch.zeros_like(corrected)
        sent_local[indices] = values  # a repeated index writes the same value
        message = values.float()
        self.comm.mean_(message)
        # The all-reduce may add a repeated index's copies in different orders (they sit at
        # different places of the message), so they can differ in the last bit; which copy a
        # parallel scatter writes last is then a race. Every copy takes its run's first value.
        message = message[first_of_runs(indices)]
        scale = 1.0 / (1.0 - (1.0 - 1.0 / n) ** k) if self.rescale else 1.0
        average = torch.zeros_like(corrected)
        average[indices] = message.to(average.dtype) * scale
        self._finish(names, grads, flat, corrected, sent_local, average, k, k * 4)

    def state_dict(self) -> dict:
        """The error feedback's state and the draws' seed.

        Returns:
            The state, for ``load_state_dict``.
        """
        return {**super().state_dict(), "seed": self.seed}


class QSGDState(ErrorFeedbackReducer):
    """8-bit stochastic quantisation (QSGD with max-abs scaling per chunk), one all-gather; error feedback.

    Per chunk of ``chunk`` elements: scale = max|x| / 127, q = ⌊|x|/scale + u⌋·sign(x) with
    u ~ U[0, 1) (so E[q·scale] = x), sent as int8 followed by the chunk scales as bytes. The noise u
    is drawn on the gradients' device from a generator seeded by (``seed``, rank, step, call):
    independent between ranks, and the same again in a resumed run.

    Args:
        process_group: as `GradientReducer`'s.
        chunk: the elements per scale.
        error_feedback: keep the quantisation error for the next step.
        seed: of the noise.
        model: as `GradientReducer`'s.

    Raises:
        ValueError: ``chunk`` is not an integer ≥ 1.
    """

    method = "qsgd8"
    ARGUMENTS = ("chunk", "seed")
    LEVELS = 127

    def __init__(
        self, process_group=None, *, chunk: int = 1024, error_feedback: bool = True, seed: int = 714, model=None
    ):
        super().__init__(process_group, error_feedback=error_feedback, model=model)
        if not (isinstance(chunk, int) and chunk >= 1):
            raise ValueError(f"chunk: must be an integer ≥ 1, got {chunk!r}")
        self.chunk = chunk
        self.seed = int(seed)

    def quantize(self, x: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantise ``x`` to 8-bit levels, unbiased over the noise.

        Args:
            x: the values.
            generator: the noise's, on x's device.

        Returns:
            (int8 levels of shape x, fp32 scale per chunk), whose `dequantize` ≈ x.
        """
        n = x.numel()
        chunks = math.ceil(n / self.chunk)
        padded = torch.zeros(chunks * self.chunk, dtype=torch.float32, device=x.device)
        padded[:n] = x
        blocks = padded.view(chunks, self.chunk)
        scale = blocks.abs().amax(dim=1) / self.LEVELS
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        level = blocks.abs().div_(safe.unsqueeze(1))
        noise = torch.rand(level.shape, generator=generator, device=x.device)
        level.add_(noise).floor_().clamp_(max=self.LEVELS).mul_(blocks.sign())
        return level.view(-1)[:n].to(torch.int8), scale

    def dequantize(self, levels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The values of `quantize`'s levels.

        Args:
            levels: the int8 levels.
            scale: the fp32 scale per chunk.

        Returns:
            The values, fp32, of the levels' shape flattened.
        """
        n = levels.numel()
        chunks = scale.numel()
        padded = torch.zeros(chunks * self.chunk, dtype=torch.float32, device=levels.device)
        padded[:n] = levels
        return padded.view(chunks, self.chunk).mul_(scale.unsqueeze(1)).view(-1)[:n]

    def _reduce(self, names, grads, flat) -> None:
        corrected = self._corrected(names, grads)
        n = corrected.numel()
        noise = seeded_generator(corrected.device, self.seed, "qsgd", self.comm.rank, self.step, self._call)
        levels, scale = self.quantize(corrected, noise)
        message = torch.cat([levels, scale.view(torch.int8)])
        sent_local = self.dequantize(levels, scale).to(corrected.dtype)
        average = torch.zeros_like(corrected)
        for part in self.comm.all_gather(message):
            average.add_(self.dequantize(part[:n], part[n:].clone().view(torch.float32)).to(average.dtype))
        average.div_(self.comm.world_size)
        self._finish(names, grads, flat, corrected, sent_local, average, message.numel(), message.numel())

    def state_dict(self) -> dict:
        """The error feedback's state and the noise's seed (no generator: the noise is seeded per call).

        Returns:
            The state, for ``load_state_dict``.
        """
        return {**super().state_dict(), "seed": self.seed}
