"""The two-stage compressed all-reduce: the sync-method registry's third collective kind (``TWO_STAGE``).

One call averages a flat run of n values (a DiLoCo fragment's pseudo-gradients, the call's tensors
end to end) over a process group of N members, P ≤ N of which contribute (a torchft quorum may hold
spares). The run is cut into buckets sized from it (`edgc.sync.flat_buffers.bucket_plan`: about
sixteen, or a fixed ``bucket_values`` each); each bucket into N chunks of C = ⌈values/N⌉ (the last
padded with zeros), chunk j owned by group rank j. The codec takes a bucket's N chunks at once, as
the rows of an [N, C] view (`edgc.sync.codecs`), so a bucket costs the same launches at any N. Per bucket:

1. **Scatter.** Each contributor forms M = e + Δ in its error feedback e (one flat buffer per call,
   its parameters' entries views of it: `error`), encodes the N rows, and keeps e ← M − what the
   messages carry, in the same place. A spare sends an all-zero message and keeps its e as it was:
   its Δ is of a model that took no part (torchft zeroes a non-participant's contribution too). An
   all-to-all sends chunk j's message to its owner.
2. **Reduce.** The owner decodes the N messages of its chunk and sums them (one reduction: fp32, fp64
   for fp64 tensors), divides by P, adds its own error feedback for the chunk (`owner_error`), encodes
   the result and keeps what that message did not carry.
3. **Gather.** An all-gather of the owners' messages; every rank decodes all N of them straight into
   the call's tensors. Every rank decodes the same bytes, so replicas end bit-identical.

Wire per rank per bucket: (N − 1) chunk messages in each stage, 2 (N − 1)/N × the encoded bucket in
all, flat in N (an all-gather of whole messages sends N − 1 of them): the call's ``bytes_sent``; the
encoded buckets, what one replica's messages hold, are its ``payload_bytes``. Memory: a bucket's
messages and, while it is encoded or decoded, about 10 bytes a value of it, for at most three
buckets at once (one scattering, one reducing, one gathering: the pipeline that keeps the wire busy):
under a byte a value of the run. Collectives are issued from the caller's thread in bucket order,
the same on every rank, and waited on before their results are read (`edgc.distributed.comm`).

Conservation. Over a committed call, output + mean of the contributors' new e + the owners' new error
feedback = mean of the contributors' M + the owners' old error feedback (to rounding): nothing is
lost, only delayed. The owner's error feedback belongs to this partition of the run (group size,
this rank, bucket layout); when the next call finds another partition (a quorum changed) it is
dropped, with a line on the ``edgc`` logger: at most the rounding of one average, once per change.
It is decayed with the rest (`group_error_table`) and dropped at a heal: each rank owns other chunks.

Uncommitted steps (``defer_commit``, torchft's verdict): the owner's error feedback goes to a new
tensor until the verdict, and on a rollback each contributor's e becomes its whole M again (its own
messages are kept for that: the encoded size, not a copy of Δ; values that are not finite are
dropped), so a caller keeps no copy of its input (`rollback_keeps_input`).

The codec contract (what a new method implements; `edgc.sync.codecs.QuantCodec` is the first; a subclass names
its codec's settings in ``ARGUMENTS``, compared across the group with the codec's class, `edgc.distributed.agreement`):

* ``message_bytes(n)``: bytes of the message of n values, a multiple of 4, a function of n alone
  (every rank knows every message's size without asking);
* ``encode_rows(x, out)``: writes the message of each row of ``x`` ([R, C]) into the row of ``out``
  ([R, message_bytes(C)], uint8) and returns the values they decode to, [R, C] in ``x``'s dtype, bit
  for bit those `decode_rows` returns (the sender's error feedback is exactly what the receivers did
  not get); ``decode_rows(messages, n, dtype, out=None)``: the [R, n] values, into ``out`` if given;
  an all-zero message decodes to zeros (a spare's). A codec of one run at a time (``encode(x, out)``,
  ``decode(message, n, dtype)``) is called row by row; ``row_multiple`` (default 8): rows of a
  multiple of it need no padding.
"""

from __future__ import annotations

import torch

from ..device import streams
from ..device.finite import all_finite
from ..distributed.comm import FINISHES, ISSUES_MORE
from ..runner import events
from ..runner.error_feedback import ErrorFeedback
from ..runner.reducer import GradientReducer
from ..runner.stats import ReduceStats
from .codecs import QuantCodec, decode_rows, decode_run, encode_rows, encode_run
from .error_feedback import BASELINE_FORMAT, COMPRESSED, load_feedback, method_settings
from .flat_buffers import Partition, bucket_plan, flat_run

__all__ = ["Partition", "TwoStageQuantState", "TwoStageReducer", "bucket_plan"]


class _Bucket:
    """One bucket in flight: its bounds, the collective it waits for, the buffers that must outlive it."""

    def __init__(self, lo: int, hi: int, chunk: int, size: int, owner_at: int):
        self.lo, self.hi, self.chunk, self.size = lo, hi, chunk, size
        self.owner_at = owner_at  # where its chunk's owner error feedback starts
        self.pending = None
        self.keep: tuple = ()  # buffers a collective in flight reads or writes


class _Call:
    """One call's view of the state: its run of values, its error feedback, the owner's, its statistics."""

    def __init__(self, state: TwoStageReducer, names: list[str], grads: list[torch.Tensor], flat):
        self.grads = grads
        self.dtype = torch.float64 if grads[0].dtype == torch.float64 else torch.float32
        comm, device = state.comm, grads[0].device
        sizes = tuple(g.numel() for g in grads)
        bucket, _ = state.buckets(sum(sizes), comm.group_size)
        rows = 1 if state.bucket_values is not None else getattr(state.codec, "row_multiple", 1)
        self.partition = Partition(sizes, comm.group_size, comm.group_rank, bucket, rows)
        self.contributes, self.participants = comm.rank >= 0, max(1, comm.world_size)
        # The tensors as one run, averaged in place (copied out and back where they are not one buffer)
        self.run = flat_run(grads, flat)
        self.copied = self.run is None
        if self.copied:
            self.run = torch.cat([g.reshape(-1) for g in grads])
        self.error = state.feedback.flat(names, grads, self.dtype) if state.error_feedback else None
        self.owner_in, self.owner_out = state.owner_error_of(names[0], self.partition, self.dtype, device)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        # what it sent (``bytes_sent``: 2 (N − 1)/N of the payload) and measured, added to bucket by bucket
        self.stats = ReduceStats(sum(sizes), 0, sum(sizes) * grads[0].element_size(), 0, zero, zero, zero.bool())
        self.stats.ranks = {name: 0 for name in names}
        self.payload = 0  # encoded bytes of its buckets
        self.undo: list[tuple[int, int, int, torch.Tensor]] = []  # (lo, hi, chunk, own message) per bucket

    def finish(self) -> None:
        if self.copied:
            for g, part in zip(self.grads, self.run.split(self.partition.sizes)):
                g.copy_(part.view(g.shape))


class TwoStageReducer(GradientReducer):
    """The two-stage compressed all-reduce with ``codec`` (see the module docstring), in buckets of
    ``bucket_values`` values (None: sized from each call's run, `bucket_plan`). ``process_group``,
    ``error_feedback`` and ``model`` as `edgc.sync.baselines`' states; without error feedback neither
    stage keeps a remainder. Two `edgc.runner.error_feedback.ErrorFeedback`: the senders' (``feedback``,
    flat per call, written in place bucket by bucket) and the owners' (``owners``, tied to the call's
    partition); it shares `edgc.sync.error_feedback`'s checks and checkpoint format, not its reducer's
    M = G + e."""

    method = "two-stage"
    ARGUMENTS: tuple[str, ...] = ("bucket_values",)  # agreed before the first sync; a codec's own: a subclass's

    def __init__(
        self,
        process_group=None,
        *,
        codec,
        bucket_values: int | None = None,
        error_feedback: bool = True,
        model=None,
    ):
        super().__init__(process_group, model=model)
        # name -> this rank's residual, a view of its call's flat buffer; a rollback makes it M again
        self.feedback = ErrorFeedback(error_feedback, rollback="resend")
        if not (bucket_values is None or (isinstance(bucket_values, int) and bucket_values >= 1)):
            raise ValueError(f"bucket_values: values per bucket, None or an integer ≥ 1, got {bucket_values!r}")
        self.codec, self.bucket_values = codec, bucket_values
        # the owners' error feedback per call (keyed by its first name): the values of the owned chunks
        self.owners = ErrorFeedback(error_feedback, rollback="restore", layout=_partition)
        self._undo: list[_Call] = []  # the pending step's calls, for a rollback
        self._payload = 0  # encoded bytes of this step's buckets

    def buckets(self, values: int, members: int) -> tuple[int, int]:
        """(values per bucket, buckets) of a call of ``values`` over ``members``: two collectives a bucket."""
        return bucket_plan(values, members, self.bucket_values, getattr(self.codec, "row_multiple", 8))

    def agreed_settings(self, device: torch.device) -> dict:
        """`GradientReducer.agreed_settings` with ``error_feedback``, `ARGUMENTS` and the codec's class."""
        codec = {f"{type(self).__name__}.codec": type(self.codec).__qualname__}
        return {**super().agreed_settings(device), **method_settings(self), **codec}

    @property
    def error_feedback(self) -> bool:
        """Whether both stages keep what their messages did not carry."""
        return self.feedback.enabled

    @property
    def error(self) -> dict[str, torch.Tensor]:
        """This rank's own error feedback by parameter name (views of the calls' buffers)."""
        return self.feedback.table

    @property
    def owner_error(self):
        """The owners' error feedback per call, key → (partition, values of the owned chunks): a live view."""
        return self.owners.by_layout()

    @property
    def rollback_keeps_input(self) -> bool:
        """A rolled-back step leaves each tensor's whole M in the error feedback (see the module docstring)."""
        return self.error_feedback

    def owner_error_of(self, key: str, partition: Partition, dtype, device) -> tuple:
        """(the owner's error feedback a call reads, the tensor it writes): the same tensor unless
        the step may be rolled back; none without error feedback; zero where the partition changed."""

        def changed(before: Partition, now: Partition) -> None:
            events.owner_error_dropped(self.settings_group().rank, type(self).__name__, self.step, key, before, now)

        make = lambda: torch.zeros(partition.owned(), dtype=dtype, device=device)  # noqa: E731
        return self.owners.tied(key, partition, make, fresh=self.defer_commit, changed=changed)

    def error_feedbacks(self) -> list[ErrorFeedback]:
        """`GradientReducer.error_feedbacks`: this rank's own (``feedback``) and the owners' (``owners``)."""
        return [self.feedback, self.owners]

    def group_error_table(self) -> dict[str, torch.Tensor]:
        """The error feedback this rank keeps as the owner of chunks, by call (the state's own tensors):
        decayed with `error_table`'s, dropped at a heal (`edgc.sync.outer_sync`)."""
        return dict(self.owners.table)

    def drop_group_error(self, reason: str) -> None:
        """Drop the owners' error feedback (a heal: no other rank holds the chunks this one owns), with a
        line on the ``edgc`` logger giving ``reason``."""
        rank = self.settings_group().rank
        self.owners.drop(lambda: events.owner_error_cleared(rank, type(self).__name__, self.step, reason))

    # ------------------------------------------------------------------ one call, bucket by bucket
    def _plan_step(self, record) -> None:
        self._undo, self._payload = [], 0

    def _reduce(self, names, grads, flat):
        return self._two_stage(_Call(self, names, grads, flat))

    def _two_stage(self, call: _Call):
        """The job (`edgc.distributed.comm`): bucket t scatters while bucket t − 1 reduces and t − 2 is gathered."""
        if self.defer_commit:
            self._undo.append(call)
        buckets: list[_Bucket | None] = []
        at = 0
        for index, (lo, hi, chunk) in enumerate(call.partition.buckets()):
            bucket = _Bucket(lo, hi, chunk, self.codec.message_bytes(chunk), at)
            at += chunk
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
        call.finish()
        self._payload += call.payload
        return call.stats

    def _scatter(self, call: _Call, bucket: _Bucket) -> None:
        """Stage 1: M of the bucket, its N rows encoded into the all-to-all; e ← what they did not carry."""
        members, chunk, size = call.partition.members, bucket.chunk, bucket.size
        device = call.run.device
        if not call.contributes:  # a spare: zeros on the wire; its Δ dropped, its error feedback kept as it is
            message = torch.zeros(members * size, dtype=torch.uint8, device=device)
        else:
            message = torch.empty(members * size, dtype=torch.uint8, device=device)
            delta = call.run[bucket.lo : bucket.hi]
            if call.error is not None:
                m = call.error[bucket.lo : bucket.hi]
                m += delta  # M = e + Δ, formed in the error feedback
            else:
                m = delta.to(call.dtype)
            call.stats.norm_sq = call.stats.norm_sq + torch.dot(m, m)
            # e ← M − sent, in place (without error feedback, M − sent is for the statistics alone)
            for part in encode_run(self.codec, m, chunk, message.view(members, size), call.error is not None):
                part = part.reshape(-1)
                call.stats.error_sq = call.stats.error_sq + torch.dot(part, part)
            if self.defer_commit and call.error is not None:
                call.undo.append((bucket.lo, bucket.hi, chunk, message))
        received = torch.empty_like(message)
        bucket.pending = self.comm.all_to_all_async(received, message)
        bucket.keep = (message, received)
        call.payload += members * size
        call.stats.bytes_sent += 2 * (members - 1) * size
        call.stats.elements_sent = call.stats.bytes_sent

    def _exchange(self, call: _Call, bucket: _Bucket) -> None:
        """Stage 2: the owner's chunk, summed, averaged, encoded again into the all-gather."""
        members, chunk, size = call.partition.members, bucket.chunk, bucket.size
        received = bucket.pending.wait().view(members, size)
        total = decode_rows(self.codec, received, chunk, call.dtype).sum(dim=0)
        total /= call.participants
        owned = slice(bucket.owner_at, bucket.owner_at + chunk)
        if call.owner_in is not None:
            total += call.owner_in[owned]
        mine = torch.empty(1, size, dtype=torch.uint8, device=received.device)
        sent = encode_rows(self.codec, total.view(1, chunk), mine)
        if call.owner_out is not None:
            torch.sub(total, sent.view(-1), out=call.owner_out[owned])
        del total, sent
        gathered = torch.empty(members * size, dtype=torch.uint8, device=received.device)
        bucket.pending = self.comm.all_gather_into_async(gathered, mine.view(-1))
        bucket.keep = (mine, gathered)

    def _gather(self, call: _Call, bucket: _Bucket) -> None:
        """Stage 3: every owner's message decoded into the call's run."""
        members, chunk, size = call.partition.members, bucket.chunk, bucket.size
        gathered = bucket.pending.wait().view(members, size)
        target = call.run[bucket.lo : bucket.hi]
        for values in decode_run(self.codec, gathered, chunk, target, call.dtype):
            call.stats.nonfinite = call.stats.nonfinite | ~all_finite(values)
        bucket.keep = ()

    # ------------------------------------------------------------------ uncommitted steps
    def _settle_step(self, record, totals) -> dict:
        return {**COMPRESSED, "payload_bytes": self._payload}

    def _on_verdict(self, committed: bool, snapshot: dict) -> None:
        """Rolled back (the owners' error feedback is back already): each contributor's e ← its whole M
        again (e + what its own messages carried; not finite: 0)."""
        if not committed:
            for call in self._undo:
                self._resend(call)
        self._undo = []

    def _resend(self, call: _Call) -> None:
        members = call.partition.members
        for lo, hi, chunk, message in call.undo:
            size = self.codec.message_bytes(chunk)
            decode_run(self.codec, message.view(members, size), chunk, call.error[lo:hi], call.dtype, add=True)
            # made on the jobs' side stream, read here on the caller's: not reused before that read
            streams.record_stream(message, streams.current_stream(message.device))
        if call.error is not None and call.undo:
            call.error.masked_fill_(~torch.isfinite(call.error), 0)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        base = {"format": BASELINE_FORMAT, "method": self.method, **super().state_dict()}
        own = {"bucket_values": self.bucket_values, "owner_error": self.owners.state_dict()}
        return {**base, **self.feedback.state_dict(), **own}

    def load_state_dict(self, state: dict) -> None:
        owner = state.get("owner_error", {})
        if not isinstance(owner, dict):
            raise ValueError(f"corrupt {self.method} state: 'owner_error' must be a table")
        owners = ErrorFeedback(self.error_feedback, rollback="restore", layout=_partition)
        owners.load_state_dict(owner, what=self.method)  # the one format, or the (partition…, values) of before
        load_feedback(self, self.feedback, state, super().load_state_dict)
        self.owners = owners
        if self.device is not None:
            self._on_device(self.device)


def _partition(saved: list) -> Partition:
    """A partition from its saved values (sizes, members, rank, bucket[, row multiple: 1 before it was saved])."""
    return Partition(tuple(saved[0]), *saved[1:])


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
        bucket_values: int | None = None,
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
