"""How a gradient-sync state is used, checked where a mistake would otherwise pass in silence.

Each check fails with one line (or warns once) and changes nothing of the state:

* **The process group.** A state built with ``process_group=None`` before ``init_process_group``
  (easy when a launcher or a framework creates the group later) would average over its own
  process alone, and the replicas would drift apart. It binds the default group at its first use
  instead (its first step, ``state_dict()`` or ``load_state_dict()``). With no process group even
  then, it averages over this process alone and warns once. Given a DDP model (``model=``), it
  refuses to average over other ranks than the ones DDP's own process group holds.
* **The parameters.** With ``model=``, every parameter it syncs must be the model's (a ``model=``
  that is not the module DDP wraps would key the compressor's state by the wrong names). On the
  DDP path every step syncs the parameters of the first: one state registered on two DDP models
  is refused at the other model's first bucket.
* **Settings that must agree.** At the first step, before anything is sent, the ranks compare
  every setting that shapes a collective or a decision (`edgc.distributed.agreement`); one that differs raises
  `SettingsDiffer` on every rank, naming it and each rank's value.
* **``synchronize()`` needs gradients**: called before ``backward()``, it refuses.
* **``synchronize()`` once per backward**: called again on the gradients it averaged last, every
  one of them the very tensor it left and unchanged since (no backward, no ``zero_grad``, no other
  in-place change: each tensor's version counter says so), it refuses instead of averaging the
  average again and counting a second step. A gradient changed in place by anything else (clipped,
  scaled) counts as a new one.

`GradientReducer` holds one `UsageGuard`, which also knows the model's parameters by name (the
names key every per-parameter state, so checkpoints survive another DDP bucket layout), and calls
it at those points.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..adapters import torch_adapter
from ..distributed.agreement import agree
from ..distributed.comm import Communicator
from ..distributed.detached import DetachedCommunicator
from ..distributed.expert_sync import Experts
from ..distributed.experts import expert_marks
from ..distributed.mesh import local_tensor
from ..distributed.scaling import GradientScale


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def ddp_group_ranks(model: nn.Module | None) -> list[int] | None:
    """The global ranks of the process group ``model`` (a DDP model, or torch.compile's wrapper of
    one) averages over; None for any other module."""
    ddp = getattr(model, "_orig_mod", model)
    if not isinstance(ddp, nn.parallel.DistributedDataParallel) or not _distributed():
        return None
    try:
        return list(dist.get_process_group_ranks(ddp.process_group))
    except (RuntimeError, ValueError):  # a group c10d does not know (e.g. torchft's dummy): not comparable
        return None


def group_ranks(comm: Communicator) -> list[int]:
    """The global ranks of the group ``comm`` averages over (None: the default group)."""
    group = comm.group if comm.group is not None else dist.group.WORLD
    return list(dist.get_process_group_ranks(group))


def ddp_synced_names(model: nn.Module | None) -> list[str] | None:
    """The names of the parameters ``model`` (a DDP model, or torch.compile's wrapper of one) averages:
    those that need a gradient and it does not ignore; None for any other module."""
    ddp = getattr(model, "_orig_mod", model)
    if not isinstance(ddp, nn.parallel.DistributedDataParallel):
        return None
    ignored = ddp.parameters_to_ignore
    return [name for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored]


def named_parameters(model: nn.Module | None) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) pairs without DDP's ``module.`` prefix, so names survive (un)wrapping."""
    if model is None:
        return []
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return list(inner.named_parameters())


class UsageGuard:
    """What one state knows of its model, and the checks of how it is used (see the module docstring).
    ``model``: the module whose parameters the state syncs, or None. Plain data, so it pickles with
    the state (without the ids of this process's tensors: meaningless elsewhere, reusable by new ones)."""

    def __init__(self, model: nn.Module | None):
        self.model_given = model is not None
        self.ddp_ranks = ddp_group_ranks(model)
        parameters = named_parameters(model)
        self.names = {id(p): name for name, p in parameters}  # id(parameter) → its name
        self.shapes = {name: tuple(local_tensor(p).shape) for name, p in parameters}  # for checking loaded state
        self.experts = Experts(expert_marks(model), self.shapes)  # its stacked experts (`edgc.distributed.experts`)
        self.scale = GradientScale()  # the one place gradients are scaled (`edgc.distributed.scaling`)
        self.ddp_synced = ddp_synced_names(model)  # what a DDP model hands its buckets, checked at the first step
        self.checked = False  # the first-use checks ran
        self.agreed = False  # the group compared its settings (`edgc.distributed.agreement`)
        self.also_agreed: dict[str, Any] = {}  # settings an integration added (`GradientReducer.agree_on`)
        self.decision_comm: Communicator | None = None  # the ranks that must act alike, where more (`decide_over`)
        self.warned_unnamed = False
        self.ddp_names: frozenset[str] | None = None  # the parameters of the first DDP step, once it ended
        self._first_step_names: list[str] = []
        self._synced: list[tuple[weakref.ref, int]] = []  # the gradients synchronize() left, with their versions

    def __getstate__(self) -> dict:
        """A process group stays with this process, as the state's communicator does (`edgc.distributed.detached`)."""
        wider = self.decision_comm
        if wider is not None:
            wider = DetachedCommunicator("sync state", wider.rank, wider.world_size)
        return {**self.__dict__, "names": {}, "_synced": [], "decision_comm": wider}

    def decide_over(self, group: dist.ProcessGroup | None) -> None:
        """The ranks that must act alike where they are more than the state's group (None: the state's
        alone): they compare the settings at the first step (`agree`), and their rank 0 speaks for them
        (`GradientReducer.settings_group`)."""
        self.decision_comm = None if group is None else Communicator(group)

    def fresh_gradients(self, state_name: str, grads: list[torch.Tensor]) -> None:
        """Refuse a ``synchronize()`` on the gradients the last one left, every one unchanged since."""
        synced = self._synced
        if (
            synced
            and len(synced) == len(grads)
            and all(
                ref() is grad and torch_adapter.version(local_tensor(grad)) == version
                for (ref, version), grad in zip(synced, grads)
            )
        ):
            raise RuntimeError(
                f"{state_name}.synchronize() was called again on the gradients it averaged last, unchanged "
                "since: call it once after each backward (it would average the average and count a second step)"
            )

    def synchronized(self, grads: list[torch.Tensor]) -> None:
        """``synchronize()`` left these gradients (weakly held: a gradient freed is a changed one)."""
        self._synced = [(weakref.ref(grad), torch_adapter.version(local_tensor(grad))) for grad in grads]

    def names_for(self, state_name: str, params) -> list[str]:
        """The names of ``params``; a parameter the model does not name is named by first appearance
        (`unnamed`)."""
        names = []
        for p in params:
            name = self.names.get(id(p))
            if name is None:
                name = self.names[id(p)] = self.unnamed(state_name, len(self.names))
            names.append(name)
        return names

    def bound(self, comm: Communicator) -> Communicator:
        """The communicator a state holding ``comm`` averages over: where ``comm`` was built for the default
        group before it existed, that group's, if it exists now (until the first step: a state that has
        stepped keeps the group it stepped with); else ``comm``."""
        if not self.checked and type(comm) is Communicator and comm.awaits_default_group and _distributed():
            return Communicator(None)
        return comm

    def first_use(self, name: str, comm: Communicator) -> None:
        """At the first use of the state called ``name`` (later calls return at once): check the group
        its ``comm`` (already `bound`) averages over (warns once without any)."""
        if self.checked:
            return
        self.checked = True
        if type(comm) is not Communicator:  # torchft's manager, or an unpickled state: theirs to check
            return
        if not comm.issues:
            warnings.warn(
                f"{name}: no process group is initialised, so it averages over this process alone and "
                "sends nothing (build it after dist.init_process_group to average over the group)",
                stacklevel=5,
            )
            return
        if self.ddp_ranks is not None and group_ranks(comm) != self.ddp_ranks:
            raise RuntimeError(
                f"{name} averages over global ranks {group_ranks(comm)} but its DDP model over "
                f"{self.ddp_ranks}: give it DDP's group (process_group=ddp_model.process_group)"
            )

    def agree_on(self, state_name: str, settings: dict[str, Any]) -> None:
        if self.agreed:
            raise RuntimeError(f"{state_name}.agree_on: the group compared its settings at the first step")
        self.also_agreed.update(settings)

    def agree(
        self,
        name: str,
        comm: Communicator,
        settings_group: Communicator,
        settings: Callable[[torch.device], dict[str, Any]],
        device: torch.device,
    ) -> None:
        """At the first step of the state called ``name`` (later calls return at once), before it plans or
        sends anything: compare its ``settings`` (by device) over ``settings_group`` (`edgc.distributed.agreement`; the
        collectives on ``device``, the gradients'); ``comm``: the group it averages over. Not under
        torchft's manager, whose replicas come and go."""
        if self.agreed:
            return
        if self.ddp_synced:  # an expert DDP would hand it: refused before the first bucket is sent
            self.check_experts(name, comm, self.ddp_synced)
        if type(settings_group) is Communicator and settings_group.issues:
            ranks = group_ranks(comm)
            self.also_agreed.update(self.experts.agreed(ranks))
            self.also_agreed.update(self.scale.agreed(comm.world_size, self.experts.held(ranks)))
            agree(settings_group, name, settings(device), device, group_ranks(settings_group))
        self.agreed = True

    def check_experts(self, name: str, comm: Communicator, names: list[str]) -> None:
        """Refuse, in one line, an expert parameter among ``names`` that the state called ``name`` (averaging
        over ``comm``'s group) cannot average (`edgc.distributed.expert_sync.Experts.check_group`): before
        its first step sends anything."""
        if self.experts.marks and type(comm) is Communicator and comm.issues:
            self.experts.check_group(name, names, lambda: group_ranks(comm))

    def prepare(self, name: str, comm: Communicator, names: list[str], grads: list[torch.Tensor]):
        """``names`` and ``grads`` as the state's method takes them: each gradient scaled
        (`edgc.distributed.scaling`), each stacked experts gradient then split into its experts' matrices
        (`edgc.distributed.expert_sync.Experts.expand`); an expert parameter this state cannot average is refused."""
        self.check_experts(name, comm, names)
        self.scale.apply(names, grads, comm.world_size, self.experts.ep)
        return self.experts.expand(names, grads)

    def unnamed(self, state_name: str, index: int) -> str:
        """The name of a parameter no model names: its place in order of appearance, stable for one DDP
        bucket layout (warns once). Refused when a model was given: the parameter is not that model's."""
        if self.model_given:
            raise RuntimeError(
                f"{state_name}: a parameter it was asked to sync is not in its model= (pass the "
                "DDP model it is registered on, or the module that model wraps)"
            )
        name = f"param{index}"
        if not self.warned_unnamed:  # once: the same holds for every such name
            self.warned_unnamed = True
            warnings.warn(
                f"{state_name}: a parameter without a name (no model= given) is called {name} by "
                "bucket order, so state_dict() loads only into a run with the same DDP bucket layout; "
                "pass model=ddp_model",
                stacklevel=3,
            )
        return name

    def ddp_bucket(self, state_name: str, comm: Communicator, params, grads, last: bool):
        """The names of a DDP bucket's ``params`` (`names_for`) and its ``grads`` with each stacked experts
        gradient scaled and split into its experts' matrices (`prepare`; None for a sparse bucket's, which is
        not split); ``last`` ends the step. Refuses parameters the first step did not sync."""
        names = self.names_for(state_name, params)
        if self.ddp_names is None:
            self._first_step_names.extend(names)
            if last:
                self.ddp_names, self._first_step_names = frozenset(self._first_step_names), []
        elif any(name not in self.ddp_names for name in names):
            raise RuntimeError(
                f"{state_name}: a DDP bucket holds parameters its first step did not sync: one "
                "state serves one DDP model (register a state of its own on each model)"
            )
        if grads is None:
            return names, None
        return self.prepare(state_name, comm, names, list(grads))


def check_gradients(state_name: str, params: list[torch.Tensor]) -> None:
    """``synchronize()`` after ``backward()``: refuse a call where no parameter has a gradient yet."""
    if params and all(p.grad is None for p in params):
        raise RuntimeError(
            f"{state_name}.synchronize() found no gradient on any parameter: call it after "
            "loss.backward() (a parameter without one counts as zero only when others have one)"
        )
