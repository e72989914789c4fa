"""A sync state under torchft's manager: its collectives through the manager, its steps by the
manager's verdict, its shared state to a healing replica (`edgc.integrations.torchft` has the whole).

`ManagedCommunicator` is the `edgc.distributed.comm.Communicator` whose collectives go through a replica
group's ``Manager``; `ManagedSteps` is what the manager does to any `GradientReducer` that uses it:
defer each step until ``manager.should_commit()`` says whether to commit or roll it back, and
register the state's shared part for a replica that heals.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions

from ..distributed.comm import Communicator
from ..runner.reducer import GradientReducer
from . import torchft_adapter

try:
    from torchft.manager import Manager
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("edgc.integrations.torchft needs torchft: pip install 'edgc[torchft]'") from error


class _Watched:
    """A work whose wait never raises and tells the communicator when it failed; a failure the
    manager has not heard of (a work issued on its process group directly) is reported to it."""

    def __init__(self, work, communicator: ManagedCommunicator, timeout: timedelta | None = None):
        self._work, self._communicator, self._timeout = work, communicator, timeout

    def wait(self) -> bool:
        try:
            if self._work is None:
                done = True
            elif self._timeout is not None:
                done = self._work.wait(self._timeout) is not False
            else:
                done = self._work.wait() is not False
        except Exception as error:  # noqa: BLE001 - a direct process-group work: a peer died, a timeout
            done = False
            if self._communicator.manager.errored() is None:
                self._communicator.manager.report_error(error)
        if not done:
            self._communicator.collective_failed = True
        return done


class ManagedCommunicator(Communicator):
    """`Communicator` whose collectives go through a torchft ``Manager`` (one replica group's rank).

    After an error, torchft's manager skips the step's remaining collectives. Here that happens
    only once a collective itself has failed (the group's connections are suspect). An error that
    did not come from a collective — raised on issue, or reported by the caller — leaves the
    group sound, so the rest of the step's collectives still run on the quorum's process group,
    and peers that have not seen the error are not left waiting for this replica until a timeout.

    Args:
        manager: the replica group's torchft ``Manager``.
    """

    flags_nonfinite = True  # a non-finite step is reported to the manager, so every replica discards it
    # A replica group's error feedback is its own whatever the quorum's size: quorums change between
    # steps, and before the first one the size is 1 (a checkpoint loaded then keeps it).
    residuals_per_rank = False

    def __init__(self, manager: Manager):
        super().__init__(None)
        self.manager = manager
        self.world_size, self.rank, self.root = 1, 0, 0
        self.collective_failed = False
        self._place = (0, 1)  # (rank, size) in the quorum's process group
        self.refresh()

    @property
    def issues(self) -> bool:
        """A quorum of one sends nothing."""
        return self.world_size > 1

    @property
    def waits_on_device(self) -> bool:
        """The manager's works are waited for as the host's (`Communicator.waits_on_device`)."""
        return False

    def refresh(self) -> None:
        """Take the current quorum's size and this replica's place in it (blocks on a pending quorum)."""
        if not torchft_adapter.quorum_started(self.manager):
            return  # no quorum started yet (construction): nothing to ask
        self.world_size = max(1, self.manager.num_participants())
        rank = self.manager.participating_rank()
        self.rank = -1 if rank is None else rank  # a spare never proposes a decision
        self._place = _group_place(self.manager, self.rank, self.world_size)

    @property
    def group_size(self) -> int:
        """Members of the quorum's process group, spares included (1 in a quorum of one participant)."""
        return self._place[1] if self.issues else 1

    @property
    def group_rank(self) -> int:
        return self._place[0] if self.issues else 0

    @property
    def step_failed(self) -> bool:
        """A collective of this step failed, or the manager holds an error: the step is lost."""
        return self.collective_failed or self.manager.errored() is not None

    def reset(self) -> list[float]:
        """End a step now and start the next afresh: no collective of it has failed yet.

        Returns:
            The durations (s) of the ended step's collectives in issue order.
        """
        durations = super().reset()
        self.collective_failed = False
        self.refresh()  # at a step's start: the quorum started before the forward pass
        return durations

    def poll(self) -> None:
        """Managed works have no cheap completion query: durations run from issue to wait."""

    def report_nonfinite(self, owner: str, step: int) -> None:
        """Report a NaN/Inf average to the manager as an error, so that no replica commits the step.

        Args:
            owner: the state whose average it was, named in the error.
            step: the step whose average it was.
        """
        self.manager.report_error(
            RuntimeError(f"{owner}: non-finite gradient average at step {step}; the step is discarded on every replica")
        )

    def _all_reduce_work(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType):
        manager = self.manager
        if self.collective_failed:
            return _Watched(None, self)  # the step is lost and the group is suspect: issue nothing more
        if manager.errored() is None:
            return _Watched(manager.allreduce(tensor, reduce_op=op), self)  # zeroes a non-participant's tensor
        try:  # the step is lost, the group is sound: keep in step with peers that do not know it yet
            options = AllreduceOptions()
            options.reduceOp = op
            return _Watched(torchft_adapter.process_group(manager).allreduce([tensor], options), self)
        except Exception:  # noqa: BLE001 - already reported; nothing left to keep in step with
            self.collective_failed = True
            return _Watched(None, self)

    # torchft's manager offers only all-reduce; its process group runs all-to-all and all-gather
    # on gloo and NCCL alike, so the two-stage sync (`edgc.sync.two_stage`) issues them there directly,
    # under the manager's timeout, and reports a failure to the manager itself (`_Watched`).
    def _direct(self, start):
        if self.collective_failed:
            return _Watched(None, self)  # the step is lost and the group is suspect: issue nothing more
        try:
            manager = self.manager
            return _Watched(start(torchft_adapter.process_group(manager)), self, torchft_adapter.timeout(manager))
        except Exception as error:  # noqa: BLE001 - reported: the step is not committed
            self.manager.report_error(error)
            self.collective_failed = True
            return _Watched(None, self)

    def _all_to_all_work(self, out: torch.Tensor, tensor: torch.Tensor):
        options = AllToAllOptions()
        options.timeout = torchft_adapter.timeout(self.manager)
        return self._direct(lambda pg: pg.alltoall_base(out, tensor, [], [], options))

    def _all_gather_into_work(self, out: torch.Tensor, tensor: torch.Tensor):
        options = AllgatherOptions()
        options.timeout = torchft_adapter.timeout(self.manager)
        return self._direct(lambda pg: pg.allgather_into_tensor_coalesced([out], [tensor], options))

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The quorum's rank 0's ``tensor`` on every replica: an all-reduce (sum) that only it feeds.

        Args:
            tensor: this replica's tensor, overwritten in place.

        Returns:
            ``tensor``, holding rank 0's values.
        """
        if self.world_size == 1:
            return tensor
        if self.rank != 0:
            tensor.zero_()
        return self.all_reduce(tensor)

    def _broadcast_work(self, tensor: torch.Tensor):  # pragma: no cover - broadcast() is overridden
        raise NotImplementedError

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every participant's ``tensor``, in participating-rank order. torchft's manager offers no
        all-gather, so it is a summing all-reduce of one slot per participant, each filled by its
        owner alone (a non-participant's tensor is zeroed by the manager): twice an all-gather's traffic.

        Args:
            tensor: this replica's tensor.

        Returns:
            One tensor per participant.
        """
        if self.world_size == 1:
            return [tensor]
        slots = tensor.new_zeros((self.world_size, *tensor.shape))
        if self.rank >= 0:
            slots[self.rank].copy_(tensor)
        self.all_reduce(slots)
        return list(slots.unbind(0))

    def _all_gather_work(
        self, out: list[torch.Tensor], tensor: torch.Tensor
    ):  # pragma: no cover - all_gather is overridden
        raise NotImplementedError


def _group_place(manager: Manager, rank: int, participants: int) -> tuple[int, int]:
    """(rank, size) of this replica in the quorum's process group: the members a two-stage sync's
    chunks are owned by, spares included; the wrapped group's (``parent``) where there is one, else the
    group's own (torchft's ``ProcessGroupBaby*``, whose size is the quorum's), else the participants.
    The chunks go by the group's own ranks; the rank here labels the owner's error feedback."""
    group = torchft_adapter.process_group(manager)
    try:
        group = group.parent
    except (AttributeError, AssertionError):
        pass
    try:
        return group.rank(), group.size()
    except (AttributeError, AssertionError, NotImplementedError, RuntimeError):
        return max(rank, 0), participants


class ManagedSteps:
    """torchft's side of one sync state (see the module docstring).

    The state's collectives go through the manager (`ManagedCommunicator`, which also reports a
    non-finite average to it), each step waits for the manager's verdict (``manager.should_commit()``
    settles the step, then commits or rolls it back: `finish_step`), and the state's shared part is
    registered for a healing replica. ``steps_discarded``, ``heals`` and ``steps_uncounted`` count what
    the faults cost.

    Args:
        state: the sync state, any `GradientReducer`.
        manager: the replica group's torchft ``Manager``.
        state_key: the key the shared part is registered under with the manager.
        shared: a callable returning the state's shared part.
        load_shared: a callable a healing replica loads the shared part with.
        uncounted: called on a committed step, a reason to roll it back all the same (EDGC: a profiling
            step timed in a quorum of one), or None.
    """

    def __init__(self, state: GradientReducer, manager: Manager, state_key: str, shared, load_shared, uncounted=None):
        state.attach(ManagedCommunicator(manager), defer_commit=True)
        self.state, self.manager = state, manager
        self._shared, self._load_shared, self._uncounted = shared, load_shared, uncounted
        self.steps_discarded = 0  # steps whose sync ran but which the manager did not commit
        self.heals = 0  # times the shared state was received from a peer
        self.steps_uncounted = 0  # committed steps rolled back all the same (``uncounted``)
        manager.register_state_dict_fn(state_key, self._heal, shared)
        self._wrap_should_commit()

    def shared_state_dict(self) -> dict:
        """What every replica holds alike, as a healing replica receives it.

        Returns:
            The shared part of the state.
        """
        return self._shared()

    def _heal(self, state: dict) -> None:
        self._load_shared(state)
        self.heals += 1

    def finish_step(self, committed: bool) -> None:
        """The manager's verdict on the pending step: commit it, or roll it back.

        Args:
            committed: whether the manager committed the step.
        """
        state = self.state
        if not state.pending:
            return
        if not committed:
            self.steps_discarded += 1
            state.rollback_step("torchft's manager did not commit it")
        elif (reason := self._uncounted() if self._uncounted is not None else None) is not None:
            self.steps_uncounted += 1
            state.rollback_step(reason)
        else:
            state.commit_step()

    def _wrap_should_commit(self) -> None:
        """Make ``manager.should_commit()`` commit or roll back the state's pending step with its verdict."""
        decide = self.manager.should_commit

        def should_commit(timeout: timedelta | None = None) -> bool:
            try:
                # The step settles before the verdict: a non-finite average is reported to the manager
                # (`ManagedCommunicator.report_nonfinite`: no replica commits it), and a rank decision
                # is taken now, while every replica of the quorum is at this point, so the shared
                # state a healing replica receives has it.
                self.state.settle()
                committed = decide(timeout)
            except BaseException:
                self.finish_step(False)
                raise
            self.finish_step(committed)
            return committed

        self.manager.should_commit = should_commit  # type: ignore[method-assign]
