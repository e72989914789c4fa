"""What the PowerSGD engine keeps between steps, and how a step's changes are kept or undone.

Per parameter name: the warm-start Q (n × r, identical on every rank) and this rank's error
feedback e (m × n). Per call layout, the buffers its stretches read and write
(`edgc.engine.call_buffers.CallBuffers`): the *arena* whose (m, n) views are the error feedback of the
call's compressed matrices (M = G + e is formed in place), the factors (Pᵀ and two Qᵀ buffers used
in turn: a step reads one and writes the other, no copy, no allocation), and the rows that restart a
Q row that collapsed to zero.

``q`` and ``error`` (the table of ``feedback``, the engine's `edgc.runner.error_feedback.ErrorFeedback`) are
plain dicts the engine keeps pointing into those buffers; anything that
replaces an entry (a checkpoint, a rank change) breaks the match, and the next call of that layout
rebuilds its buffers from the dicts. So the dicts are always the truth, and the buffers a cache.

A step's changes (`begin_step` … `end_step` / `commit` / `rollback`): after a non-finite step the
error feedback it touched is cleared (M = G + e was formed in place before anyone knew of the
NaN/Inf, and with a GradScaler the kept residual would come back at twice its size), Q turns back to
the buffer the step started from, and Q factors resized for a new rank get their old shape back.
With ``uncommitted=True`` the residual goes to a second arena so that M survives: `commit` keeps
the residual, `rollback` makes M the error feedback again (zeroing the matrices whose M is not
finite).
"""

from __future__ import annotations

import torch

from ..adapters import torch_adapter
from ..config import LowRankConfig
from ..device import streams
from ..device.timing import state_to_device, state_to_host, to_device
from ..runner.error_feedback import ErrorFeedback, fill_views, views_intact
from ..runner.seeds import stable_seed
from .call_buffers import CallBuffers
from .factors import matrix_shape
from .layout import CallLayout


def subtracts_estimate(cpu_kernels: bool, estimate_in_arena_dtype: bool) -> bool:
    """Whether a call forms its residual as e = M − Ĝ from the Ĝ just written rather than as a second
    rank-r product: on a CPU (and not counting the accelerator's kernels there) an element-wise pass
    is cheaper than that product, and exact where Ĝ has the arena's dtype. An accelerator keeps the
    product, which never reads Ĝ back (the fewest bytes). The simulator asks this too."""
    return cpu_kernels and estimate_in_arena_dtype


class EngineMemory:
    """The engine's memory between steps (Q and the error feedback, as PowerSGD's memory dicts) and its step
    protocol (see the module docstring); the
    `edgc.engine.lowrank.LowRankCompressor` that holds it (``compressor.state``) computes on it.
    ``config``: the engine's `LowRankConfig`."""

    def __init__(self, config: LowRankConfig):
        self.config = config
        self.q: dict[str, torch.Tensor] = {}  # name → (n, r), identical on every rank
        # name → (m, n), this rank's residual; a rollback makes it M again (the second arena)
        self.feedback = ErrorFeedback(config.error_feedback, rollback="resend")
        self.shapes: dict[str, tuple[int, int]] = {}  # name → (m, n) of every matrix seen
        self.shares: dict[
            str, int
        ] = {}  # name → its own rank where a rank split gives it one (`edgc.policies.rank_split`)
        self.orthonormalization: str | None = None  # the group's method (`edgc.engine.orthonormal_choice`), once chosen
        self.keep_uncommitted = False
        self._calls: dict[tuple, CallBuffers] = {}
        self._tracking = False  # between begin_step and the step's resolution
        self._touched: list[torch.Tensor] = []  # arenas whose error feedback this step wrote
        self._resized: dict[str, torch.Tensor] = {}  # Q factors as they were before this step resized them
        self._q_turns: list[tuple[CallBuffers, int]] = []  # (call, the Q buffer it started this step from)
        self._step_arenas: list[tuple[CallBuffers, torch.Tensor]] = []  # uncommitted: (call, its M arena)
        self._step_popped: dict[str, torch.Tensor] = {}  # error feedback moved into raw-sent gradients

    @property
    def error(self) -> dict[str, torch.Tensor]:
        """name → (m, n) error feedback of this rank (``feedback``'s table)."""
        return self.feedback.table

    # ------------------------------------------------------------------ the step protocol
    def begin_step(self, *, uncommitted: bool = False) -> None:
        """Track what the coming step changes, for `end_step`, `commit` and `rollback`."""
        self.keep_uncommitted = uncommitted
        self._tracking = True
        self._touched, self._resized, self._step_arenas, self._step_popped = [], {}, [], {}
        self._q_turns = []

    def end_step(self, nonfinite: bool) -> None:
        """The step's non-finite flag is known (on the host, at its end): after a non-finite step clear
        the error feedback it touched, turn Q back to the buffer the step started from, and give resized
        Q factors their old shape back."""
        if nonfinite:
            for arena in self._touched:
                arena.zero_()
            for call, turn in reversed(self._q_turns):  # the earliest last: a Q from before the step
                self._keep_q(call, turn)
            self.q.update(self._resized)
        self._touched, self._resized, self._q_turns = [], {}, []
        if not self.keep_uncommitted:
            self._tracking = False

    def commit(self) -> None:
        """The uncommitted step is applied: its residuals stay the error feedback; its M arenas become spares."""
        for call, m_arena in self._step_arenas:
            call.spare = m_arena
        self._step_arenas, self._step_popped, self._tracking = [], {}, False

    def rollback(self) -> None:
        """The uncommitted step is discarded: the error feedback becomes M = G + e of the step again, so
        nothing of its gradient is lost, and error feedback moved into raw-sent gradients comes back.
        An M that holds a NaN/Inf (this replica's gradient was not finite) cannot be kept: that
        matrix is zeroed, as a non-finite step's residual is."""
        for call, m_arena in self._step_arenas:
            for group in call.layout.groups:
                block = group.error_view(m_arena)
                finite = torch.isfinite(block).flatten(1).all(1)
                block.masked_fill_(~finite.view(-1, 1, 1), 0.0)
            call.spare = call.arena
            self._use_arena(call, m_arena)
        self.error.update(self._step_popped)
        self._step_arenas, self._step_popped, self._tracking = [], {}, False

    def snapshot(self) -> dict:
        """The shared state (Q) as it is now, cheaply: references, and which of each call's two Q buffers
        is the current one, nothing copied (`restore`).

        The contract: a snapshot holds for one step. A step reads the current Q buffer and writes the
        other, so after the next step the snapshot's buffer is still intact and `restore` turns back to
        it (an uncommitted step rolled back, a shadow sync undone); a second step writes into it. Restore
        before the second step begins, as the reducer's step protocol does (a pending step must be
        committed or rolled back before the next one)."""
        return {"q": dict(self.q), "calls": {key: (c.factors, c.turn) for key, c in self._calls.items()}}

    def restore(self, snapshot: dict) -> None:
        """Back to ``snapshot`` (`snapshot`: within one step of it)."""
        self.q = dict(snapshot["q"])
        for key, (factors, turn) in snapshot["calls"].items():
            call = self._calls.get(key)
            if call is not None and call.factors is factors:
                call.turn = turn

    def drop_error(self) -> None:
        """Forget every residual (they are per rank: a new world size cannot split or merge them)."""
        self.feedback.drop()
        for call in self._calls.values():
            call.arena, call.spare, call.error_views = None, None, []

    @property
    def tracking(self) -> bool:
        """Between `begin_step` and the step's resolution (`end_step`, or `commit`/`rollback`)."""
        return self._tracking

    def note_resized(self, previous: dict[str, torch.Tensor]) -> None:
        if self._tracking:
            for name, q in previous.items():
                self._resized.setdefault(name, q)

    # ------------------------------------------------------------------ per-call buffers
    def open_call(
        self, names: list[str], grads: list[torch.Tensor], rank: int, compute: torch.dtype
    ) -> tuple[CallBuffers, torch.Tensor]:
        """A call of the engine begins: its kept buffers, made where they are not (a new layout, a
        checkpoint, a rank change), and where M = G + e is to be formed (its arena; scratch without
        error feedback). Nothing on the device yet but for those rebuilds: the call's stretches form
        M and the rest (`edgc.engine.stretches`). A matrix sent raw now (after a rank change) takes its
        pending residual along. ``compute``: the dtype of M and the factors."""
        call = self._call_buffers(names, grads, rank)
        self._flush_into_raw(call.layout, grads)
        device = grads[0].device
        if not self.config.error_feedback:
            arena = call.scratch
            if arena is None or arena.dtype != compute or arena.device != device:
                arena = call.scratch = torch.empty(call.layout.error_numel, dtype=compute, device=device)
        else:
            error_dtype = grads[0].dtype if self.config.error_feedback_dtype == "gradient" else compute
            if not self._arena_intact(call, error_dtype, device):
                self._rebuild_arena(call, error_dtype, device)
            arena = call.arena
            if self._tracking and not self.keep_uncommitted:
                self._touched.append(arena)
        if call.layout.groups:
            if not self._q_intact(call, compute, device):
                self._gather_q(call, device, compute)
            if call.replacement is None or call.replacement.device != device:
                call.replacement = self._replacement_rows(call, device)
        return call, arena

    def residual_target(self, call: CallBuffers, arena: torch.Tensor) -> torch.Tensor:
        """Where the call's residual e = M − P·Qᵀ goes: over M in its arena, or (uncommitted) into the
        spare arena, M left intact for a rollback."""
        if not self.keep_uncommitted:
            return arena
        spare = call.spare
        if spare is None or spare.shape != arena.shape or spare.dtype != arena.dtype:
            spare = call.spare = torch.empty_like(arena)
        return spare

    def close_call(self, call: CallBuffers, arena: torch.Tensor, residual: torch.Tensor | None) -> None:
        """A call ends (its stretches ran): its Q is the other buffer now, the one the group's average was
        written to. Within a tracked step the buffer it started from is remembered, and `end_step`
        turns back to it after a non-finite step (nothing selected on the device, nothing copied);
        outside one, the finish stretch kept the stored Q in the new buffer on the device where the
        group saw a NaN/Inf. An uncommitted step's residual arena becomes the error feedback."""
        if residual is not None and residual is not arena:
            call.spare = None
            self._step_arenas.append((call, arena))
            self._touched.append(residual)  # a non-finite step clears the residual, never M
            self._use_arena(call, residual)
        if not call.layout.groups:
            return
        if self._tracking:
            self._q_turns.append((call, call.turn))
        self._keep_q(call, 1 - call.turn)

    def rank_for(self, name: str, rank: int) -> int:
        """The rank ``name`` is compressed at when the step's rank is ``rank`` (its share, if it has one)."""
        return self.shares.get(name, rank)

    def _call_buffers(self, names: list[str], grads: list[torch.Tensor], rank: int) -> CallBuffers:
        key = (tuple(names), rank, tuple(self.shares.get(name, 0) for name in names) if self.shares else ())
        shapes = tuple(tuple(g.shape) for g in grads)
        call = self._calls.get(key)
        if call is None or call.shapes != shapes:
            # A new layout for these names (a rank change, DDP's bucket rebuild): drop the old ones'
            # buffers, whose values live on in the dicts until this call's rebuild copies them.
            overlap = set(names)
            replaced = [k for k in self._calls if overlap.intersection(k[0])]
            ranks = sorted({k[1] for k in replaced})
            for other in replaced:
                del self._calls[other]
            call = self._calls[key] = CallBuffers(
                CallLayout.plan(names, grads, rank, self.config.min_compression_rate, self.shares), shapes
            )
            if ranks and ranks != [rank]:
                call.reason = f"a rank change ({', '.join(map(str, ranks))} → {rank})"
            elif replaced:
                call.reason = "a new layout (the bucket's tensors changed)"
            for name, grad in zip(names, grads):
                if (shape := matrix_shape(grad)) is not None:
                    self.shapes[name] = shape
        return call

    def _flush_into_raw(self, layout: CallLayout, grads: list[torch.Tensor]) -> None:
        """A matrix sent raw now (after a rank change) takes its pending residual with it."""
        for i in layout.raw:
            pending = self.error.pop(layout.names[i], None)
            if pending is not None:
                grads[i].add_(pending.view_as(grads[i]).to(grads[i].dtype))
                if self.keep_uncommitted:
                    self._step_popped[layout.names[i]] = pending

    def _arena_intact(self, call: CallBuffers, dtype: torch.dtype, device: torch.device) -> bool:
        return views_intact(call.arena, call.error_views, self.error, call.layout.compressed_names, dtype, device)

    def _rebuild_arena(self, call: CallBuffers, dtype: torch.dtype, device: torch.device) -> None:
        """The arena from the error dict (a first step, a checkpoint, a rank change): zeros where a
        matrix has no residual yet. Where the dict's entries already lie in one buffer exactly where
        this layout places them (a rank change that keeps the compressed matrices, their order and so
        their shape groups' places), that buffer is the arena: rebuilt in place, no second arena
        alive beside the old one, nothing copied."""
        arena = self._arena_in_place(call, dtype, device)
        if arena is None:
            arena = torch.zeros(call.layout.error_numel, dtype=dtype, device=device)
            fill_views(self.error, call.layout.compressed_names, call.views(arena))
        call.spare = None
        self._use_arena(call, arena)

    def _arena_in_place(self, call: CallBuffers, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        names = call.layout.compressed_names
        base = torch_adapter.view_base(self.error.get(names[0])) if names else None
        if (
            base is None
            or base.dim() != 1
            or base.numel() != call.layout.error_numel
            or base.dtype != dtype
            or base.device != device
        ):
            return None
        for name, view in zip(names, call.views(base)):
            kept = self.error.get(name)
            if kept is None or torch_adapter.view_base(kept) is not base:
                return None
            if kept.storage_offset() != view.storage_offset() or kept.shape != view.shape:
                return None
        return base

    def _use_arena(self, call: CallBuffers, arena: torch.Tensor) -> None:
        call.arena = arena
        call.error_views = call.views(arena)
        self.error.update(zip(call.layout.compressed_names, call.error_views))

    # ------------------------------------------------------------------ Q
    def _q_intact(self, call: CallBuffers, dtype: torch.dtype, device: torch.device) -> bool:
        factors = call.factors
        if factors is None or factors.dtype != dtype or factors.device != device:
            return False
        return views_intact(
            call.q(call.turn), call.q_views[call.turn], self.q, call.layout.compressed_names, dtype, device
        )

    def _gather_q(self, call: CallBuffers, device: torch.device, compute: torch.dtype) -> None:
        """The call's Q buffers anew, the current one from the dict (a first step, a checkpoint, a rank
        change): a new factors buffer, so that nothing read from the dict is overwritten while read."""
        stored = {name: self.q.get(name) for name in call.layout.compressed_names}
        columns = {}
        for group in call.layout.groups:
            self.note_resized(
                {n: stored[n] for n in group.names if stored[n] is not None and stored[n].shape[1] != group.rank}
            )
            columns[id(group)] = [
                self.resized_q(name, group.n, group.rank, device).to(compute).T for name in group.names
            ]
        call.make_factors(compute, device)
        for group in call.layout.groups:
            group.q_view(call.q(0)).copy_(torch.stack(columns[id(group)]))
        self._keep_q(call, 0)

    def resized_q(self, name: str, n: int, rank: int, device: torch.device) -> torch.Tensor:
        """This parameter's warm-start Q (``n`` = its column count) with exactly ``rank`` columns: the
        first ``rank`` of the stored ones, or those followed by columns drawn from a generator seeded
        by (seed, name, old rank, new rank); a seeded draw where none is stored (`edgc.engine.rank_change`)."""
        q = self.q.get(name)
        if q is not None and q.shape[0] != n:
            q = None  # the parameter changed shape: start over
        if q is None:
            generator = torch.Generator().manual_seed(stable_seed(self.config.seed, name))
            q = to_device(torch.randn(n, rank, generator=generator), device)
        elif q.shape[1] > rank:
            q = q[:, :rank]
        elif q.shape[1] < rank:
            generator = torch.Generator().manual_seed(stable_seed(self.config.seed, name, q.shape[1], rank))
            extra = to_device(torch.randn(n, rank - q.shape[1], generator=generator), device)
            q = torch.cat([q, extra], dim=1)
        return q

    def _replacement_rows(self, call: CallBuffers, device: torch.device) -> torch.Tensor:
        """Unit rows laid out as the call's Q buffer: one (r, n) set per Q block, drawn once and repeated
        for each of its matrices (a restarted direction only has to be non-zero and the same on every
        process, so bfloat16 holds it in half the memory of a Q), so that the restart is one select over
        the whole buffer."""
        drawn = []
        for block in call.layout.q_blocks:
            generator = torch.Generator().manual_seed(stable_seed(self.config.seed, "reseed", block.rank, block.side))
            rows = torch.randn(block.rank, block.side, generator=generator, dtype=torch.float64)
            drawn.append((rows / rows.norm(dim=1, keepdim=True)).reshape(-1).repeat(block.count))
        rows = torch.cat(drawn) if drawn else torch.empty(0, dtype=torch.float64)
        return to_device(rows.to(torch.bfloat16), device)

    def _keep_q(self, call: CallBuffers, turn: int) -> None:
        call.turn = turn
        self.q.update(zip(call.layout.compressed_names, call.q_views[turn]))

    def state_bytes(self) -> int:
        """Device bytes the engine keeps between steps: error feedback, Q, restart rows (and the spare
        arena of uncommitted steps)."""
        buffers = {
            id(t): t
            for c in self._calls.values()
            for t in (c.arena, c.spare, c.factors, c.replacement, c.identity, c.scratch, *c.step_tensors())
            if t is not None
        }
        kept = {id(t.untyped_storage()) for t in buffers.values()}
        loose = [t for t in (*self.q.values(), *self.error.values()) if id(t.untyped_storage()) not in kept]
        return sum(t.numel() * t.element_size() for t in (*buffers.values(), *loose))

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self, *, include_error: bool = True) -> dict:
        """Q, error feedback (unless ``include_error`` is False: the part every replica shares) and the
        matrix shapes (for a rank change after a resume), on the CPU: a checkpoint, where the host
        waits for the device."""
        return {
            "q": state_to_host(self.q),
            **(self.feedback.state_dict() if include_error else {"error": {}}),
            "shapes": {name: list(shape) for name, shape in self.shapes.items()},
            "orthonormalization": self.orthonormalization,
        }

    def load_state_dict(self, state: dict, *, keep_error: bool = False) -> None:
        """A checkpoint's or a peer's state (``keep_error``: this rank's error feedback stays, as a healing
        replica keeps its own). Its orthonormalisation, where it has one, is the group's (a resumed or
        healed replica times nothing); else the one chosen so far stays."""
        self.q = dict(state["q"])
        if not keep_error:
            self.feedback.load_state_dict(state, what="EDGC")
        self.shapes = {name: (int(m), int(n)) for name, (m, n) in state.get("shapes", {}).items()}
        self.orthonormalization = state.get("orthonormalization") or self.orthonormalization
        self._calls.clear()
        self.begin_step()
        self._tracking = False

    def to(self, device: torch.device, stream: streams.Stream | None = None) -> None:
        """Q and error feedback onto ``device`` for ``stream``, the jobs' stream that reads and replaces
        them (`edgc.device.timing.state_to_device`)."""
        self.q = state_to_device(self.q, device, stream)
        self.feedback.to(device, stream)
        self._calls.clear()
