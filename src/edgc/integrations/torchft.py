"""EDGC across torchft replica groups: compressed gradients that survive a replica failing and coming back.

    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper
    from edgc.integrations.torchft import DistributedDataParallel, QuorumSettings

    quorum = QuorumSettings.for_groups(groups, tolerated_failures=1)  # and the lighthouse: quorum.lighthouse_args()
    manager = Manager(pg=ProcessGroupGloo(), use_async_quorum=False, load_state_dict=..., state_dict=...,
                      **quorum.manager_kwargs())
    model = DistributedDataParallel(manager, model, EDGCConfig(total_steps=10_000))  # the one call
    optimizer = OptimizerWrapper(manager, torch.optim.AdamW(model.parameters()))
    # loop: optimizer.zero_grad(); loss.backward(); optimizer.step()   — as with torchft's own DDP

Over links too slow for a sync every step: `DiLoCo` (torchft's DiLoCo and Streaming DiLoCo, whose
outer sync of pseudo-gradients is EDGC's, or a registered sync method's: `managed_sync_state`;
`edgc.integrations.diloco` has the algorithm).

What the one call sets up (`TorchFTEDGCState`):

* **Every collective through the manager.** Raw tensors, P, Q, the agreement and the decision
  "broadcast" (an all-reduce to which only the quorum's rank 0 contributes), r_max profiling:
  all go through ``manager.allreduce``, so a failure is reported to the manager and the step is
  not committed — nothing hangs or raises. Averages divide by ``manager.num_participants()``, as
  torchft's own hook does. After an error that did not come from a collective, the rest of the
  step's collectives still run (see `ManagedCommunicator`), so that no peer waits for a timeout.
* **A failed step loses nothing.** ``manager.should_commit()`` is wrapped: True commits the
  EDGC step (except a profiling step in a quorum of one: timing no link, it is not counted),
  False rolls it back (`GradientReducer.rollback_step`): the accumulated gradient M of
  every compressed matrix becomes the error feedback again, Q, the step counter, the controller,
  the window and the entropy series are as before the step. A non-finite gradient average (a NaN
  on any replica) is reported as an error, so every replica discards that step.
* **Heal.** The shared state is registered with ``manager.register_state_dict_fn("edgc", ...)``:
  a replica that joins or restarts receives it from a healthy peer with the model and starts at
  the quorum's step and rank (with no error feedback of its own). Needs
  ``use_async_quorum=False``: the state must be in place before the step's first collective,
  whose shape depends on the rank.

Per replica: the error feedback (what this replica's gradients have not yet sent) and the
entropy series (samples of its own gradient; the quorum's rank 0 decides from its series).
Shared, and identical on every replica: the step counter, the Q factors, the rank schedule and
the controller (phase, r_max/r_min, decisions, profiling table). They change only through
averaged values and decisions sent to all, so they stay identical; a replica that did not commit
a step its peers committed is behind, and torchft heals it from a peer at the next quorum (its
own error feedback is kept). A restarted replica takes the series of the peer it heals from.
"""

from __future__ import annotations

from torch import nn

from ..config import EDGCConfig
from ..policies.plans import PROFILE
from ..runner.reducer import edgc_hook
from ..state import EDGCState
from ..sync.sync_methods import sync_method
from . import torchft_adapter
from .diloco import DiLoCo as _DiLoCo
from .torchft_managed import ManagedCommunicator, ManagedSteps
from .torchft_quorum import QuorumSettings

try:
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupDummy
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("edgc.integrations.torchft needs torchft: pip install 'edgc[torchft]'") from error

STATE_KEY = "edgc"

__all__ = [
    "DistributedDataParallel",
    "DiLoCo",
    "TorchFTEDGCState",
    "QuorumSettings",
    "ManagedSteps",
    "ManagedCommunicator",
    "managed_sync_state",
]


class TorchFTEDGCState(EDGCState):
    """`EDGCState` for one rank of a torchft replica group (see the module docstring); what
    `DistributedDataParallel` builds (``model.edgc_state``), and `DiLoCo`'s outer sync.

    ``steps_discarded``, ``heals`` and ``profile_steps_alone`` count what the faults cost.

    Args:
        manager: the group's torchft ``Manager`` (``use_async_quorum=False``): every collective goes
            through it, and its ``should_commit()`` commits or rolls back each step (`ManagedSteps`, as
            ``managed``).
        config: as `EDGCState`'s.
        model: as `EDGCState`'s.
        state_key: the key of the shared state the manager sends a healing replica.

    Raises:
        ValueError: the manager was built with ``use_async_quorum=True``.
    """

    def __init__(
        self,
        manager: Manager,
        config: EDGCConfig | None = None,
        *,
        model: nn.Module | None = None,
        state_key: str = STATE_KEY,
    ):
        if torchft_adapter.uses_async_quorum(manager):
            raise ValueError(
                "EDGC on torchft needs Manager(use_async_quorum=False): a healing replica must "
                "load the quorum's rank before the step's first collective"
            )
        super().__init__(None, config, model=model)
        self.managed = ManagedSteps(
            self, manager, state_key, self.shared_state_dict, self.load_shared_state_dict, self._profiled_alone
        )

    def _profiled_alone(self) -> str | None:
        """A profiling step timed in a quorum of one measured no link: the model step stands, but EDGC
        does not count it (its state is as before), so r_max is profiled once a peer is there — and
        never from a lone replica."""
        if self._last is not None and self._last.plan.phase == PROFILE and self.comm.world_size < 2:
            return "a profiling step in a quorum of one times no link; the model step stands"
        return None

    @property
    def manager(self) -> Manager:
        return self.managed.manager

    @property
    def steps_discarded(self) -> int:
        """Steps whose sync ran but which the manager did not commit."""
        return self.managed.steps_discarded

    @property
    def heals(self) -> int:
        """Times the shared state was received from a peer."""
        return self.managed.heals

    @property
    def profile_steps_alone(self) -> int:
        """Committed profiling steps not counted: a quorum of one times no link."""
        return self.managed.steps_uncounted

    def finish_step(self, committed: bool) -> None:
        """The manager's verdict on the pending step (`ManagedSteps.finish_step`).

        Args:
            committed: whether the manager committed the step.
        """
        self.managed.finish_step(committed)


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torchft's DDP with EDGC as its gradient sync: ``DistributedDataParallel(manager, module, config)``.

    Like ``torchft.ddp.DistributedDataParallel``: DDP's own process group is a dummy (torchft
    syncs the initial weights by healing), and buckets are never rebuilt, so a recovering replica
    has the same buckets as its peers. The EDGC state is ``model.edgc_state``.

    Args:
        manager: the group's torchft ``Manager`` (``use_async_quorum=False``).
        module: the model.
        config: the `EDGCConfig` of its `TorchFTEDGCState`.
        **kwargs: go to DDP.
    """

    def __init__(self, manager: Manager, module: nn.Module, config: EDGCConfig | None = None, **kwargs):
        super().__init__(module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True, **kwargs)
        self.edgc_state = TorchFTEDGCState(manager, config, model=module)
        self.register_comm_hook(self.edgc_state, edgc_hook)


class DiLoCo(_DiLoCo):
    """torchft's DiLoCo (``torchft.local_sgd.DiLoCo``, streaming fragments included) whose outer sync is
    EDGC's compressed all-reduce, through the manager (`edgc.integrations.diloco` has the algorithm).

        with DiLoCo(manager, [model], inner_optimizer, outer_optimizer, sync_every=50, config=config):
            ...  # the inner loop: backward, inner_optimizer.step(), zero_grad()

    The quorum starts when a fragment's sync does (as in torchft's DiLoCo); the manager's
    ``should_commit()`` decides each outer step. Committed, the outer optimizer steps θ_global;
    not committed, nothing of the replica's pseudo-gradient is lost (the engine makes M the error
    feedback again, Q and the controller roll back, what was sent raw is carried into the next Δ)
    and the parameters go back to θ_global. A healing replica receives the shared state: per
    fragment θ_global and the outer optimizer, and EDGC's step, Q, rank schedule and controller
    (``state_key``). Needs ``Manager(use_async_quorum=False)``, as torchft's DiLoCo does.

    Args:
        manager: the group's torchft ``Manager``; it takes the place of the process group.
        model_fragments: as `edgc.integrations.diloco.DiLoCo`'s.
        inner_optimizer: as `edgc.integrations.diloco.DiLoCo`'s.
        outer_optimizer: as `edgc.integrations.diloco.DiLoCo`'s.
        sync_every: as `edgc.integrations.diloco.DiLoCo`'s.
        config: as `edgc.integrations.diloco.DiLoCo`'s.
        backup_device: as `edgc.integrations.diloco.DiLoCo`'s.
        pin_memory: as `edgc.integrations.diloco.DiLoCo`'s.
        fragment_sync_delay: as `edgc.integrations.diloco.DiLoCo`'s.
        fragment_update_alpha: as `edgc.integrations.diloco.DiLoCo`'s.
        power_iterations: as `edgc.integrations.diloco.DiLoCo`'s.
        sync_method: as `edgc.integrations.diloco.DiLoCo`'s (its state is built by `managed_sync_state`).
        error_feedback_decay: as `edgc.integrations.diloco.DiLoCo`'s.
        state_key: names the outer sync's state among the manager's.

    Attributes:
        managed: the outer sync's torchft side (`ManagedSteps`: heals, discarded steps), once the sync is
            built.

    Raises:
        ValueError: the manager was built with ``use_async_quorum=True``.
    """

    def __init__(
        self,
        manager: Manager,
        model_fragments,
        inner_optimizer,
        outer_optimizer,
        sync_every: int,
        config: EDGCConfig | None = None,
        *,
        backup_device=None,
        pin_memory: bool = True,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        power_iterations: int = 1,
        sync_method: str | None = None,
        error_feedback_decay: float = 1.0,
        state_key: str = "edgc_diloco",
    ):
        if torchft_adapter.uses_async_quorum(manager):
            raise ValueError(
                "DiLoCo needs Manager(use_async_quorum=False): a healing replica must load the "
                "shared state before the outer sync"
            )
        self.manager, self._state_key = manager, state_key
        self.managed: ManagedSteps | None = None
        super().__init__(
            None,
            model_fragments,
            inner_optimizer,
            outer_optimizer,
            sync_every,
            config,
            backup_device=backup_device,
            pin_memory=pin_memory,
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
            power_iterations=power_iterations,
            sync_method=sync_method,
            error_feedback_decay=error_feedback_decay,
        )
        for fragment in self._fragments:
            manager.register_state_dict_fn(
                f"{state_key}_fragment_{fragment.index}", fragment.load_state_dict, fragment.state_dict
            )

    def _new_state(self, process_group, config: EDGCConfig, model: nn.Module):
        if self._sync_method is not None:
            self.managed = managed_sync_state(self._sync_method, self.manager, model, self._state_key)
            return self.managed.state
        state = TorchFTEDGCState(self.manager, config, model=model, state_key=self._state_key)
        self.managed = state.managed
        return state

    def _start_outer_step(self) -> None:
        self.manager.start_quorum()  # a healing replica receives θ_global, the outer optimizer and EDGC's state here

    def _outer_index(self) -> int:
        return self.manager.current_step()

    def _should_commit(self) -> bool:
        return self.manager.should_commit()  # commits or rolls back the outer sync's step (`ManagedSteps`)

    def _step_pre_hook(self, *args) -> None:
        self.manager.disallow_state_dict_read()  # a peer's heal must not read parameters mid-step

    def _step_post_hook(self, *args) -> None:
        self.manager.allow_state_dict_read()
        self.inner_step_done()


# ---------------------------------------------------------------------------- a registered method as DiLoCo's outer
# sync
def managed_sync_state(name: str, manager: Manager, model: nn.Module, state_key: str) -> ManagedSteps:
    """The registered sync method ``name``'s state for one torchft replica group (`DiLoCo`'s
    ``sync_method``), returned with its torchft side: the `ManagedSteps` whose ``state`` it is. Every
    collective goes through the manager (an all-gather is an all-reduce of one slot per participant);
    each step waits for the manager's verdict (committed: the residual is kept; not: the error feedback
    is as before and DiLoCo carries the step's Δ into the next one); heal: the shared part, the outer step count, is
    registered as ``state_key``, and a healed replica keeps its own error feedback, none after a
    restart (`edgc experiment diloco` measured it against a peer's copy: alike), and drops the error
    feedback it kept as a chunk owner of a two-stage sync (no peer holds it).

    Args:
        name: the registered sync method's name (`edgc.sync.sync_methods`).
        manager: the replica group's torchft ``Manager``.
        model: the model (or the fragments' modules) the method syncs.
        state_key: the key the shared part is registered under with the manager.

    Returns:
        The method's torchft side, a `ManagedSteps`; its ``state`` is the method's state.

    Raises:
        ValueError: no sync method is registered as ``name``.
    """
    entry = sync_method(name)
    if entry is None:
        raise ValueError(f"sync method {name!r} is not registered")
    state = entry.build(None, model=model)

    def load_step(shared: dict) -> None:
        state.step = int(shared["step"])
        if hasattr(state, "drop_group_error"):  # a two-stage sync's chunk owners': no peer holds this one's
            state.drop_group_error("healed from a peer")

    return ManagedSteps(state, manager, state_key, lambda: {"step": state.step}, load_step)
