"""The two-stage compressed all-reduce: the sync-method registry's third collective kind (``TWO_STAGE``).

One call averages a flat run of n values (a DiLoCo fragment's pseudo-gradients, the call's tensors
end to end) over a process group of N members, P ≤ N of which contribute (a torchft quorum may hold
spares). The run is cut into buckets of at most ``bucket_values`` values; each bucket into N chunks
of C = ⌈values/N⌉ (the last padded with zeros), chunk j owned by group rank j. Per bucket:

1. **Scatter.** Each contributor encodes its M = Δ + e chunk by chunk with the codec and keeps what the
   message did not carry as its error feedback e (per parameter, `error`); a spare sends an all-zero
   message and keeps all of M. An all-to-all sends chunk j's message to its owner.
2. **Reduce.** The owner decodes the N messages of its chunk, sums them in rank order in fp32 (fp64
   for fp64 tensors), divides by P, adds its own error feedback for the chunk (`owner_error`), encodes
   the result and keeps what that message did not carry.
3. **Gather.** An all-gather of the owners' messages; every rank decodes all N of them into the
   call's tensors. Every rank decodes the same bytes, so replicas end bit-identical.

Wire per rank per bucket: (N − 1) chunk messages in each stage, 2 (N − 1)/N × the encoded bucket in
all, flat in N (an all-gather of whole messages sends N − 1 of them). Memory: a bucket's M, its
messages and a chunk's sums, for at most three buckets at once (one scattering, one reducing, one
gathering: the pipeline that keeps the wire busy), so the transient memory is set by
``bucket_values``, not by the model. Collectives are issued from the caller's thread in bucket
order, the same on every rank, and waited on before their results are read (`edgc.distributed.comm`).

Conservation. Over a committed call, output + mean of the contributors' new e + the owners' new error
feedback = mean of M + the owners' old error feedback (to rounding): nothing is lost, only
delayed. The owner's error feedback belongs to this partition of the run (group size, this rank,
bucket layout); when the next call finds another partition (a quorum changed) it is dropped, with a
line on the ``edgc`` logger: at most the rounding of one average, once per change.

Uncommitted steps (``defer_commit``, torchft's verdict): the owner's error feedback goes to a new
tensor until the verdict, and on a rollback each contributor's e becomes its whole M again (its own
messages are kept for that: the encoded size, not a copy of Δ; values that are not finite are
dropped), so a caller keeps no copy of its input (`rollback_keeps_input`).

The codec contract (what a new method implements; `edgc.sync.codecs.QuantCodec` is the first; a subclass names
its codec's settings in ``ARGUMENTS``, compared across the group with the codec's class, `edgc.distributed.agreement`):

* ``message_bytes(n)``: bytes of the message of n values, a multiple of 4, a function of n alone
  (every rank knows every message's size without asking);
* ``encode(x, out)``: writes the message of the flat ``x`` into ``out`` (uint8) and returns the values
  it decodes to, in ``x``'s dtype, bit for bit those `decode` returns (the sender's error feedback
  is exactly what the receivers did not get);
* ``decode(message, n, dtype)``: the n values; an all-zero message decodes to zeros (a spare's).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from ..control import events
from ..device import streams
from ..device.finite import all_finite
from ..device.timing import state_to_device, state_to_host
from ..distributed.comm import FINISHES, ISSUES_MORE
from ..engine.lowrank import ReduceStats
from .codecs import QuantCodec
from .error_feedback import BASELINE_FORMAT, COMPRESSED, checked_error, method_settings
from .reducer import GradientReducer

DEFAULT_BUCKET_VALUES = 2**19  # 2 MiB of fp32 a bucket: three in flight stay a few MiB whatever the model


class Codec(Protocol):
    """What the two-stage all-reduce asks of a codec (the module docstring has the contract)."""

    def message_bytes(self, n: int) -> int: ...

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...

    def decode(self, message: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


@dataclass(frozen=True)
class Partition:
    """How one call's run of values is cut: tensor sizes, group size and rank, values per bucket."""

    sizes: tuple[int, ...]
    members: int
    rank: int
    bucket: int

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def buckets(self) -> list[tuple[int, int, int]]:
        """(first value, end, chunk values C) of each bucket."""
        return [
            (lo, min(lo + self.bucket, self.total), math.ceil((min(lo + self.bucket, self.total) - lo) / self.members))
            for lo in range(0, self.total, self.bucket)
        ]

    def owned(self) -> int:
        """Values of the chunks this rank owns, over all buckets."""
        return sum(chunk for _, _, chunk in self.buckets())

    @functools.cached_property
    def starts(self) -> list[int]:
        """Where each tensor starts in the run."""
        return list(itertools.accumulate(self.sizes, initial=0))

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """(tensor index, its first value, its end, position from ``lo``) of the run's values [lo, hi)."""
        out, index = [], max(0, bisect.bisect_right(self.starts, lo) - 1)
        while index < len(self.sizes) and self.starts[index] < hi:
            start = self.starts[index]
            a, b = max(lo, start), min(hi, start + self.sizes[index])
            if a < b:
                out.append((index, a - start, b - start, a - lo))
            index += 1
        return out


class _Bucket:
    """One bucket in flight: its bounds, the collective it waits for, the buffers that must outlive it."""

    def __init__(self, lo: int, hi: int, chunk: int, size: int):
        self.lo, self.hi, self.chunk, self.size = lo, hi, chunk, size
        self.owner_at = 0  # where its chunk's owner error feedback starts
        self.pending = None
        self.keep: tuple = ()  # buffers a collective in flight reads or writes


class _Call:
    """One call's view of the state: its tensors, their error feedback, the owner's, its statistics."""

    def __init__(self, state: TwoStageReducer, names: list[str], grads: list[torch.Tensor]):
        self.names, self.grads = names, grads
        self.dtype = torch.float64 if grads[0].dtype == torch.float64 else torch.float32
        comm = state.comm
        self.partition = Partition(
            tuple(g.numel() for g in grads), comm.group_size, comm.group_rank, state.bucket_values
        )
        self.contributes, self.participants = comm.rank >= 0, max(1, comm.world_size)
        self.errors = [state.error_of(name, g, self.dtype) for name, g in zip(names, grads)]
        self.owner_in, self.owner_out = state.owner_error_of(names[0], self.partition, self.dtype, grads[0].device)
        self.norm_sq = self.error_sq = torch.zeros((), dtype=torch.float64, device=grads[0].device)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=grads[0].device)
        self.payload = 0
        self.undo: list[tuple[int, int, int, torch.Tensor]] = []  # (lo, hi, chunk, own message) per bucket

    def read(self, lo: int, hi: int, out: torch.Tensor, tensors: list[torch.Tensor | None]) -> None:
        """``out[:hi − lo]`` ← the run's values [lo, hi) of ``tensors`` (the gradients or the error feedback)."""
        for index, a, b, at in self.partition.pieces(lo, hi):
            source = tensors[index]
            if source is not None:
                out[at : at + b - a].copy_(source.reshape(-1)[a:b])

    def write(self, lo: int, hi: int, values: torch.Tensor, tensors: list[torch.Tensor | None], add=False) -> None:
        """The run's values [lo, hi) of ``tensors`` ← (or += with ``add``) ``values[:hi − lo]``."""
        for index, a, b, at in self.partition.pieces(lo, hi):
            target = tensors[index]
            if target is not None:
                part = target.view(-1)[a:b]
                part.add_(values[at : at + b - a]) if add else part.copy_(values[at : at + b - a])


class TwoStageReducer(GradientReducer):
    """The two-stage compressed all-reduce with ``codec`` (see the module docstring), in buckets of
    ``bucket_values`` values. ``process_group``, ``error_feedback`` and ``model`` as
    `edgc.sync.baselines`' states; without error feedback neither stage keeps a remainder. Its error
    feedback is written in place bucket by bucket and has an owner's part, so it shares
    `edgc.sync.error_feedback`'s checks and checkpoint format, not its reducer's M = G + e."""

    method = "two-stage"
    ARGUMENTS: tuple[str, ...] = ("bucket_values",)  # agreed before the first sync; a codec's own: a subclass's

    def __init__(
        self,
        process_group=None,
        *,
        codec: Codec,
        bucket_values: int = DEFAULT_BUCKET_VALUES,
        error_feedback: bool = True,
        model=None,
    ):
        super().__init__(process_group, model=model)
        self.error_feedback = bool(error_feedback)
        self.error: dict[str, torch.Tensor] = {}  # name -> this rank's residual, the parameter's shape
        if not (isinstance(bucket_values, int) and bucket_values >= 1):
            raise ValueError(f"bucket_values: values per bucket, an integer ≥ 1, got {bucket_values!r}")
        self.codec, self.bucket_values = codec, bucket_values
        # the owners' error feedback per call (keyed by its first name): (partition, values of the owned chunks)
        self.owner_error: dict[str, tuple[Partition, torch.Tensor]] = {}
        self._undo: list[_Call] = []  # the pending step's calls, for a rollback

    def agreed_settings(self, device: torch.device) -> dict:
        """`GradientReducer.agreed_settings` with ``error_feedback``, `ARGUMENTS` and the codec's class."""
        codec = {f"{type(self).__name__}.codec": type(self.codec).__qualname__}
        return {**super().agreed_settings(device), **method_settings(self), **codec}

    @property
    def rollback_keeps_input(self) -> bool:
        """A rolled-back step leaves each tensor's whole M in the error feedback (see the module docstring)."""
        return self.error_feedback

    # ------------------------------------------------------------------ state per tensor and per call
    def error_of(self, name: str, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """This rank's error feedback of ``name`` (made, zero, on first use), updated in place by the calls."""
        if not self.error_feedback:
            return None
        error = self.error.get(name)
        if error is None or error.shape != grad.shape or error.dtype != dtype:
            error = self.error[name] = torch.zeros(grad.shape, dtype=dtype, device=grad.device)
        return error

    def owner_error_of(self, key: str, partition: Partition, dtype, device) -> tuple:
        """(the owner's error feedback a call reads, the tensor it writes): the same tensor unless
        the step may be rolled back; none without error feedback; zero where the partition changed."""
        if not self.error_feedback:
            return None, None
        kept = self.owner_error.get(key)
        if kept is not None and kept[0] != partition:
            events.owner_error_dropped(
                self.settings_group().rank, type(self).__name__, self.step, key, kept[0], partition
            )
            kept = None
        current = torch.zeros(partition.owned(), dtype=dtype, device=device) if kept is None else kept[1]
        written = torch.empty_like(current) if self.defer_commit else current
        self.owner_error[key] = (partition, written)
        return current, written

    # ------------------------------------------------------------------ one call, bucket by bucket
    def _reduce(self, names, grads, flat):
        return self._two_stage(_Call(self, names, grads))

    def _two_stage(self, call: _Call):
        """The job (`edgc.distributed.comm`): bucket t scatters while bucket t − 1 reduces and t − 2 is gathered."""
        if self.defer_commit:
            self._undo.append(call)
        buckets: list[_Bucket | None] = []
        at = 0
        for index, (lo, hi, chunk) in enumerate(call.partition.buckets()):
            bucket = _Bucket(lo, hi, chunk, self.codec.message_bytes(chunk))
            bucket.owner_at, at = at, at + chunk
            self._scatter(call, bucket)
            buckets.append(bucket)
            if index >= 1:
                self._exchange(call, buckets[index - 1])
            if index >= 2:
                self._gather(call, buckets[index - 2])
                buckets[index - 2] = None
            yield ISSUES_MORE
        if buckets:
            self._exchange(call, buckets[-1])
        yield FINISHES
        for bucket in buckets[-2:]:
            if bucket is not None:
                self._gather(call, bucket)
        n = call.partition.total
        return ReduceStats(
            n,
            call.payload,
            n * call.grads[0].element_size(),
            call.payload,
            error_sq=call.error_sq,
            norm_sq=call.norm_sq,
            nonfinite=call.nonfinite,
            ranks={name: 0 for name in call.names},
        )

    def _scatter(self, call: _Call, bucket: _Bucket) -> None:
        """Stage 1: M of the bucket, encoded chunk by chunk into the all-to-all; e ← what it did not carry."""
        members, chunk, size = call.partition.members, bucket.chunk, bucket.size
        values = torch.zeros(members * chunk, dtype=call.dtype, device=call.grads[0].device)
        call.read(bucket.lo, bucket.hi, values, call.grads)
        if self.error_feedback:
            residual = torch.zeros_like(values)
            call.read(bucket.lo, bucket.hi, residual, call.errors)
            values += residual
            del residual
        call.norm_sq = call.norm_sq + torch.dot(values, values).to(torch.float64)
        message = torch.zeros(members * size, dtype=torch.uint8, device=values.device)
        if call.contributes:
            for j in range(members):
                part = values[j * chunk : (j + 1) * chunk]
                part -= self.codec.encode(part, message[j * size : (j + 1) * size])
            call.error_sq = call.error_sq + torch.dot(values, values).to(torch.float64)
            if self.defer_commit and self.error_feedback:
                call.undo.append((bucket.lo, bucket.hi, chunk, message))
        if self.error_feedback:
            call.write(bucket.lo, bucket.hi, values, call.errors)  # a spare keeps all of M
        del values
        received = torch.empty_like(message)
        bucket.pending = self.comm.all_to_all_async(received, message)
        bucket.keep = (message, received)
        call.payload += members * size

    def _exchange(self, call: _Call, bucket: _Bucket) -> None:
        """Stage 2: the owner's chunk, summed in rank order, averaged, encoded again into the all-gather."""
        members, chunk, size = call.partition.members, bucket.chunk, bucket.size
        received = bucket.pending.wait()
        total = torch.zeros(chunk, dtype=call.dtype, device=received.device)
        for i in range(members):
            total += self.codec.decode(received[i * size : (i + 1) * size], chunk, call.dtype)
        total /= call.participants
        owned = slice(bucket.owner_at, bucket.owner_at + chunk)
        if call.owner_in is not None:
            total += call.owner_in[owned]
        mine = torch.empty(size, dtype=torch.uint8, device=received.device)
        sent = self.codec.encode(total, mine)
        if call.owner_out is not None:
            torch.sub(total, sent, out=call.owner_out[owned])
        del total, sent
        gathered = torch.empty(members * size, dtype=torch.uint8, device=received.device)
        bucket.pending = self.comm.all_gather_into_async(gathered, mine)
        bucket.keep = (mine, gathered)

    def _gather(self, call: _Call, bucket: _Bucket) -> None:
        """Stage 3: every owner's message decoded into the call's tensors."""
        members, chunk, size = call.partition.members, bucket.chunk, bucket.size
        gathered = bucket.pending.wait()
        for j in range(members):
            lo = bucket.lo + j * chunk
            hi = min(lo + chunk, bucket.hi)
            if lo >= hi:
                continue
            values = self.codec.decode(gathered[j * size : (j + 1) * size], chunk, call.dtype)
            call.nonfinite = call.nonfinite | ~all_finite(values)
            call.write(lo, hi, values.to(call.grads[0].dtype), call.grads)
        bucket.keep = ()

    # ------------------------------------------------------------------ uncommitted steps
    def _plan_step(self, record) -> None:
        self._undo = []

    def _settle_step(self, record, totals) -> dict:
        return dict(COMPRESSED)

    def _snapshot(self) -> dict:
        return {**super()._snapshot(), "owner_error": dict(self.owner_error)}

    def _restore(self, snapshot: dict) -> None:
        """Each contributor's e ← its whole M again (e + what its own messages carried; not finite: 0)."""
        super()._restore(snapshot)
        self.owner_error = snapshot["owner_error"]
        for call in self._undo:
            for lo, hi, chunk, message in call.undo:
                size = self.codec.message_bytes(chunk)
                sent = torch.cat(
                    [
                        self.codec.decode(message[j * size : (j + 1) * size], chunk, call.dtype)
                        for j in range(call.partition.members)
                    ]
                )
                call.write(lo, hi, sent, call.errors, add=True)
                # made on the jobs' side stream, read here on the caller's: not reused before that read
                streams.record_stream(message, streams.current_stream(message.device))
            for error in call.errors:
                if error is not None:
                    error.masked_fill_(~torch.isfinite(error), 0)
        self._undo = []

    def _commit(self) -> None:
        self._undo = []

    def error_table(self) -> dict[str, torch.Tensor]:
        """`GradientReducer.error_table`: this rank's own error feedback, ``error`` (an owner's is its chunks')."""
        return self.error

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        host = state_to_host({key: values for key, (_, values) in self.owner_error.items()})
        owner = {
            key: (list(p.sizes), p.members, p.rank, p.bucket, host[key]) for key, (p, _) in self.owner_error.items()
        }
        own = {"bucket_values": self.bucket_values, "owner_error": owner}
        base = {"format": BASELINE_FORMAT, "method": self.method, **super().state_dict()}
        return {**base, "error": state_to_host(self.error), **own}

    def load_state_dict(self, state: dict) -> None:
        owner = state.get("owner_error", {})
        if not isinstance(owner, dict):
            raise ValueError(f"corrupt {self.method} state: 'owner_error' must be a table")
        error = checked_error(self, state)
        super().load_state_dict(state)
        self.error = error
        if int(state["world_size"]) != self.comm.world_size:
            self.error.clear()  # residuals are per rank: they cannot be split or merged
        self.owner_error = {
            key: (Partition(tuple(sizes), members, rank, bucket), values.clone())
            for key, (sizes, members, rank, bucket, values) in owner.items()
        }
        if self.device is not None:
            self._on_device(self.device)

    def _on_device(self, device: torch.device) -> None:
        # Read and replaced on the jobs' stream (`edgc.device.timing.state_to_device`)
        self.error = state_to_device(self.error, device, self._jobs.stream)
        loaded = {key: values for key, (_, values) in self.owner_error.items()}
        moved = state_to_device(loaded, device, self._jobs.stream)
        self.owner_error = {key: (p, moved[key]) for key, (p, _) in self.owner_error.items()}


class TwoStageQuantState(TwoStageReducer):
    """The two-stage all-reduce of ``bits``-bit codes with a scale per ``block`` values (`edgc.sync.codecs.QuantCodec`):
    DiLoCo's outer sync whose wire stays flat in the number of replica groups. ``process_group``,
    ``bucket_values``, ``error_feedback`` and ``model`` as `TwoStageReducer`'s."""

    method = "quantized-2s"
    ARGUMENTS = ("bits", "block", "bucket_values")  # agreed across the group before the first sync

    def __init__(
        self,
        process_group=None,
        *,
        bits: int = 3,
        block: int = 256,
        bucket_values: int = DEFAULT_BUCKET_VALUES,
        error_feedback: bool = True,
        model=None,
    ):
        super().__init__(
            process_group,
            codec=QuantCodec(bits, block),
            bucket_values=bucket_values,
            error_feedback=error_feedback,
            model=model,
        )
        self.bits, self.block = bits, block

    def state_dict(self) -> dict:
        return {**super().state_dict(), "bits": self.bits}
