"""EDGC for FSDP2 (`fully_shard`) and HSDP: compress the all-reduce between replicas.

HSDP shards parameters inside a host and replicates them across hosts; the all-reduce between
replicas crosses the slow network, and that is the one EDGC compresses:

    mesh = hsdp_mesh(shard_size, model)                 # 2-D ("dp_replicate", "dp_shard"), on the model's device
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp_shard"])          # shard over the host only: FSDP, not native HSDP
    fully_shard(model, mesh=mesh["dp_shard"])
    state = EDGCState(mesh["dp_replicate"], EDGCConfig(total_steps=10_000))
    register_fsdp_comm_hook(model, state)               # the replica all-reduce, compressed

FSDP2 reduce-scatters every parameter group over the shard dimension as usual; its all-reduce
hook (``FSDPModule.set_all_reduce_hook``) then receives the group's flat reduce-scatter output,
this rank's shards of the group's parameters back to back (each padded to the shard size). The
hook cuts it into per-parameter views, ``(rows this rank owns) × (rest)``, and averages them
over the replicate group with `GradientReducer.reduce_tensors`: the same `EDGCState` as for DDP
(warm-up, r_max profiling, entropy, window decisions agreed over the replicate group, metrics,
``state_dict()``), with error feedback and Q per shard — 1/k of DDP's EF memory for k shards.
1-D and small shards are sent raw. The views alias FSDP's buffer, so the averages land in the
sharded gradients FSDP then hands to the optimizer. With ``MixedPrecisionPolicy(reduce_dtype=
torch.bfloat16)`` the shards are bf16; factors and error feedback are fp32 (see `edgc.engine.lowrank`).

The model must be sharded on a 1-D mesh (the shard dimension): with a 2-D mesh FSDP runs its
own replica all-reduce before the hook, and there would be nothing left to compress. Every
module is sharded on one mesh, whose ranks the state's group meets only at this rank: the state
averages one shard with the same shard of the other replicas. A module on another mesh (experts
sharded on an expert-data-parallel mesh) is refused in one line: it needs a state of its own, on
the replicate group that goes with its mesh (`mesh_refusal`); so is a state whose group holds other
shards of a module (built on the shard mesh, or on the default group). Which shard each rank of
the state's group holds is compared before the first step sends anything (`edgc.distributed.agreement`).

A group's job is started in its hook and goes on while the next groups' backward runs, unless
FSDP2 reads the buffer right after the hook (it casts a ``reduce_dtype`` buffer to the parameters'
dtype, divides after the reduction, accumulates into existing gradients or offloads them: see
`reads_buffer_after_hook`); then the hook waits for the average, on the device. The step closes
(metrics, decisions, step counter) in an autograd callback queued by the first hook call of a
backward, which runs after FSDP's own final callback, so after every group, including the root's,
has been reduced: it drains the jobs still in flight, and the caller's stream waits for them. Gradient accumulation:
wrap the non-final micro-batches
in ``model.set_requires_gradient_sync(False)`` as usual; those backwards call no hook and do not
count as steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from ..adapters import fsdp_adapter, torch_adapter
from ..device import streams
from ..distributed.comm import Communicator
from ..distributed.experts import ExpertMark, expert_marks
from ..distributed.mesh import init_parallel_mesh
from ..safeguards.guards import group_ranks
from ..sync.reducer import GradientReducer

__all__ = ["hsdp_mesh", "register_fsdp_comm_hook", "FSDPCommHook", "shard_layout", "mesh_refusal", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum")
STEP_ENDS = ("backward", "caller")


def hsdp_mesh(shard_size: int, device=None) -> DeviceMesh:
    """The 2-D ``("dp_replicate", "dp_shard")`` part of the run's mesh (`edgc.distributed.mesh.init_parallel_mesh`
    with pp = tp = 1): consecutive ranks share a host. ``device``: the model to shard (or its device),
    whose device the mesh takes (`edgc.distributed.mesh.mesh_device_type`; by default the process group's).

    Shard with ``mesh["dp_shard"]``; the EDGC state takes ``mesh["dp_replicate"]``.
    """
    world = dist.get_world_size()
    if shard_size < 1 or world % shard_size:
        raise ValueError(f"shard size {shard_size} must divide the world size {world}")
    return init_parallel_mesh(device, dp_shard=shard_size)["dp_replicate", "dp_shard"]


def shard_layout(group) -> list[tuple[nn.Parameter, torch.Size, int]]:
    """(sharded parameter, this rank's shard size, padded shard numel) per parameter, in buffer order."""
    return [(fp.sharded_param, fp.sharded_size, fp.padded_sharded_param_size.numel()) for fp in group.fsdp_params]


def _described(mesh: DeviceMesh) -> str:
    return f"mesh {mesh.mesh_dim_names or '(unnamed)'} of size {mesh.size()}"


def mesh_refusal(name: str, mesh: DeviceMesh, reference: DeviceMesh, state_ranks: list[int] | None) -> str | None:
    """Why the state cannot average module ``name``'s shards (sharded on ``mesh``), or None: another mesh
    than ``reference`` (the model's first module's), or a group (global ``state_ranks``; None: not
    known) that holds other ranks of its shard mesh than this one. The same line on every rank."""
    shard_ranks = dist.get_process_group_ranks(mesh.get_group())
    if shard_ranks != dist.get_process_group_ranks(reference.get_group()):
        return (
            f"register_fsdp_comm_hook: {name} is sharded on {_described(mesh)}, the model's first sharded "
            f"module on {_described(reference)}; one state averages the shards of one mesh: {name} needs a "
            "state of its own, on the replicate group that goes with its mesh ({shard mesh: state}, one each)"
        )
    if state_ranks is not None and len(set(state_ranks) & set(shard_ranks)) > 1:
        return (
            f"register_fsdp_comm_hook: the state's group (size {len(state_ranks)}) holds other shards of "
            f"{name}'s parameters (sharded on {_described(mesh)}), and would average them together: build "
            "the state on the replicate group that goes with the shard mesh (EDGCState(mesh['dp_replicate']) "
            "beside fully_shard(..., mesh=mesh['dp_shard']))"
        )
    return None


def _sharded_modules(model: nn.Module) -> list[tuple[str, FSDPModule, object]]:
    """(name, module, its parameter group) of every `fully_shard`-ed module with parameters, in
    ``model.modules()`` order; a model sharded on a 2-D mesh is refused."""
    found, seen = [], set()
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        group = fsdp_adapter.param_group(module)
        if group is None or not group.fsdp_params or id(group) in seen:  # fully_shard([a, b]): one group, two modules
            continue
        seen.add(id(group))
        if group.mesh_info.replicate_mesh_dim is not None:  # native HSDP or replicate()
            raise ValueError(
                "shard the model on a 1-D mesh (e.g. hsdp_mesh(k)['dp_shard']): on a 2-D mesh FSDP "
                "all-reduces over the replicas itself before any hook runs"
            )
        found.append((f"module {name!r}" if name else "the model", module, group))
    return found


class FSDPCommHook:
    """The all-reduce hooks of one `fully_shard`-ed model; made by `register_fsdp_comm_hook`. ``states``:
    one state, or a state per shard mesh ({mesh: state}), each module's shards averaged by its mesh's.
    ``reduction``: "mean" (the shards averaged over the state's group) or "sum" (summed); ``step_end``:
    "backward" (a backward is a step) or "caller" (`close_step` ends it), `register_fsdp_comm_hook`'s."""

    def __init__(self, model: nn.Module, states, reduction: str = "mean", step_end: str = "backward"):
        for what, value, allowed in (("reduction", reduction, REDUCTIONS), ("step_end", step_end, STEP_ENDS)):
            if value not in allowed:
                raise ValueError(f"register_fsdp_comm_hook: {what} must be one of {allowed}, got {value!r}")
        self.reduction, self.step_end = reduction, step_end
        if not isinstance(model, FSDPModule):
            raise TypeError("register_fsdp_comm_hook needs a model that fully_shard was applied to")
        sharded = _sharded_modules(model)
        if not sharded:
            raise ValueError("the model has no parameters to reduce")
        routes = _routes(states, sharded[0][2].mesh_info.mesh)
        chosen = [_route(name, group.mesh_info.mesh, routes) for name, _, group in sharded]  # all refused first
        self.states = [state for _, state in routes]
        self.state = self.states[0]
        self.model = model
        names = {id(p): name for name, p in model.named_parameters()}
        marks = expert_marks(model)
        self._groups = []  # (module, [(name, size, padded numel)])
        shapes: dict[GradientReducer, dict] = {state: {} for state in self.states}
        for (_, module, group), (mesh, state) in zip(sharded, chosen):
            layout = []
            for fsdp_param, (param, size, padded) in zip(group.fsdp_params, shard_layout(group)):
                if not param.requires_grad:
                    continue
                name = names[id(param)]
                layout.append((name, size, padded))
                shapes[state][name] = tuple(size)
                if name in marks:  # this rank's rows of a stacked experts parameter, each expert its own matrix
                    mark = _expert_route(name, marks[name], mesh, state)
                    state.experts.hold(name, mark, _first_row(fsdp_param, mark, mesh), tuple(size))
            self._groups.append((module, layout))
            module.set_all_reduce_hook(self._make_hook(layout, group, state))
        if step_end == "backward":
            # Every parameter that requires a gradient enters every reduce-scatter (a zero gradient when
            # unused, as in DDP), so the buffer layout, and the tensors sent, are the same every step.
            model.set_reduce_scatter_unused_params(True)
        for mesh, state in routes:
            # Checkpoint checks compare error feedback with this rank's shards, not the full parameters.
            state.parameter_shapes = shapes[state]
            # The ranks of the state's group must hold the same shard: compared before anything is sent.
            shard_ranks = dist.get_process_group_ranks(mesh.get_group())
            state.agree_on({"FSDP shard": f"{shard_ranks.index(dist.get_rank())} of {len(shard_ranks)}"})
        self._open: list[GradientReducer] = []  # the states whose step this backward opened, in order
        self._reduced: dict[GradientReducer, set[str]] = {}  # step_end="caller": what this step reduced so far

    def _make_hook(self, layout, group, state: GradientReducer):
        # Padding: each shard occupies its padded numel; the trailing padding of the last shards is
        # not a gradient and is neither sent nor compressed.
        expected = sum(padded for _, _, padded in layout)
        partial: dict[int, list] = {}  # a reduce-scatter's numel → the parameters it holds (step_end="caller")

        def hook(reduce_output: torch.Tensor) -> None:
            held, numel = layout, reduce_output.numel()
            if numel != expected:
                if self.step_end != "caller":
                    raise RuntimeError(
                        f"FSDP reduce-scatter output has {numel} elements, the layout "
                        f"{expected}: parameters without requires_grad changed since registering?"
                    )
                held = partial[numel] if numel in partial else partial.setdefault(numel, partial_layout(layout, numel))
            if self.reduction == "sum" and state.comm.world_size > 1:
                # k·g averaged is the sum; exact where k is a power of two (the mean divides by k)
                reduce_output.mul_(state.comm.world_size)
            names, views, offset = [], [], 0
            for name, size, padded in held:
                numel = math.prod(size)
                view = reduce_output[offset : offset + numel].view(size)
                # a stacked experts shard stays 3-D: the state splits it by expert (`edgc.distributed.experts`)
                views.append(view if name in state.experts.marks or view.dim() < 2 else view.view(size[0], -1))
                names.append(name)
                offset += padded
            self._open_step(state, names)
            # Blocking only where FSDP2 reads the buffer as soon as this returns; otherwise the job
            # goes on while the next groups' backward runs, and the step's close drains it.
            # Every rank of the group must decide alike (blocking or not changes the order of the jobs'
            # collectives): a torchft replica that restarted has no gradients yet where its peers have them,
            # so under torchft's manager (a communicator of its own) every hook blocks.
            reads = fsdp_adapter.reads_buffer_after_hook(group, reduce_output)
            blocking = reads or type(state.comm) is not Communicator
            state.reduce_tensors(names, views, last=False, blocking=blocking)
            # A reduce buffer in another dtype than the parameters is freed by FSDP2 as soon as this
            # returns (it casts it), back to its reduce-scatter stream, which has waited neither for
            # this stream (the all-reduce one, that casts it) nor for the jobs' stream that wrote the
            # average: the next group's reduce-scatter could reuse the memory before they are done.
            # This stream has waited for the jobs' (a blocking `reduce_tensors` drains them).
            streams.record_stream(reduce_output, streams.current_stream(reduce_output.device))

        return hook

    def _open_step(self, state: GradientReducer, names: list[str]) -> None:
        if not self._open and self.step_end == "backward":
            torch_adapter.at_backward_end(self._close_step)
        if state not in self._open:
            self._open.append(state)
        if self.step_end == "caller":
            reduced = self._reduced.setdefault(state, set())
            twice = reduced.intersection(names)
            if twice:
                raise RuntimeError(
                    f"FSDP reduced {sorted(twice)[0]} twice in one step: with step_end='caller', call "
                    "close_step() once the step's backward passes are done"
                )
            reduced.update(names)

    def close_step(self) -> None:
        """End the step (``step_end="caller"``) once its backward passes are done: every state the step
        used averages what it holds and closes (metrics, decisions); each parameter must have been reduced
        exactly once since the last close. Nothing to do after a step that reduced nothing."""
        if self.step_end != "caller":
            raise RuntimeError("close_step() is for register_fsdp_comm_hook(..., step_end='caller')")
        for state in self._open:
            missing = sorted(set(state.parameter_shapes) - self._reduced.get(state, set()))
            if missing:
                self._open, self._reduced = [], {}
                raise RuntimeError(
                    f"FSDP reduced no gradient of {missing[0]} in this step ({len(missing)} parameter(s)): with "
                    "step_end='caller' every parameter that requires a gradient must get one each step"
                )
        self._reduced = {}
        self._close_step()

    def _close_step(self) -> None:
        # In the order the backward opened them: the same on every rank.
        opened, self._open = self._open, []
        for state in opened:
            state.reduce_tensors([], [], last=True)  # no tensors: closes the step on every rank

    def remove(self) -> None:
        """Unregister: FSDP goes back to no replica all-reduce at all (plain FSDP on the shard mesh)."""
        for module, _ in self._groups:
            fsdp_adapter.remove_all_reduce_hooks(module)
        self._groups = []


def _routes(states, first_mesh: DeviceMesh) -> list[tuple[DeviceMesh, GradientReducer]]:
    """(shard mesh, its state) pairs: one state goes with the model's first sharded module's mesh."""
    if isinstance(states, GradientReducer):
        return [(first_mesh, states)]
    routes = list(states.items()) if isinstance(states, Mapping) else None
    if not routes or not all(isinstance(m, DeviceMesh) and isinstance(s, GradientReducer) for m, s in routes):
        raise TypeError("register_fsdp_comm_hook takes a state, or a {shard mesh: state} mapping")
    if len({id(state) for _, state in routes}) < len(routes):
        raise ValueError("register_fsdp_comm_hook: one state averages the shards of one mesh; give each mesh its own")
    return routes


def _route(name: str, mesh: DeviceMesh, routes) -> tuple[DeviceMesh, GradientReducer]:
    """The (mesh, state) module ``name``, sharded on ``mesh``, goes with, or its refusal (`mesh_refusal`)."""
    ranks = dist.get_process_group_ranks(mesh.get_group())
    for reference, state in routes:
        if dist.get_process_group_ranks(reference.get_group()) == ranks:
            comm = state.comm
            state_ranks = group_ranks(comm) if type(comm) is Communicator and comm.issues else None
            refusal = mesh_refusal(name, mesh, reference, state_ranks)
            if refusal is None:
                return reference, state
            raise ValueError(refusal)
    raise ValueError(mesh_refusal(name, mesh, routes[0][0], None))


def _expert_route(name: str, mark: ExpertMark, mesh: DeviceMesh, state: GradientReducer) -> ExpertMark:
    """The mark of an experts parameter as its state sees it (averaged over the state's group, the shard
    mesh reducing over the rest), or its refusal: its expert-data-parallel group is not the state's group
    times its shard mesh."""
    comm = state.comm
    if type(comm) is not Communicator or not comm.issues:
        return mark
    state_ranks, shard_ranks = group_ranks(comm), dist.get_process_group_ranks(mesh.get_group())
    edp = set(mark.ranks)
    if len(edp) != len(state_ranks) * len(shard_ranks) or not (set(state_ranks) | set(shard_ranks)) <= edp:
        raise ValueError(
            f"register_fsdp_comm_hook: {name} holds experts averaged over global ranks {list(mark.ranks)}, but "
            f"its state averages over {state_ranks} and its shard mesh over {shard_ranks}: give the experts' "
            "mesh a state on the replicate group of their expert-data-parallel ranks"
        )
    return ExpertMark(mark.first, tuple(state_ranks), mark.tokens)


def _first_row(fsdp_param, mark: ExpertMark, mesh: DeviceMesh) -> int:
    """The global expert index of this rank's first row of a stacked experts parameter: its mark's first,
    plus the rows of the shards before it when FSDP shards the experts themselves (dim 0)."""
    placement = getattr(fsdp_param, "fsdp_placement", None)
    if mesh.size() == 1 or getattr(placement, "dim", 0) != 0:
        return mark.first  # every row of this rank's experts (a Shard(1) shard: a slice of each)
    rows = fsdp_adapter.unsharded_size(fsdp_param)[0]
    return mark.first + mesh.get_local_rank() * -(-rows // mesh.size())


def partial_layout(layout: list, numel: int) -> list:
    """The parameters of ``layout`` [(name, size, padded numel)] that a reduce-scatter of ``numel``
    elements holds: FSDP reduce-scatters the parameters that got gradients in a backward, in the group's
    order, so they are the one ordered subset whose padded sizes add up to ``numel``. Raises where none
    or several do (two parameters of one shard size)."""
    found: list[list] = []

    def search(start: int, left: int, chosen: list) -> None:
        if left == 0:
            found.append(list(chosen))
        for i in range(start, len(layout)):
            if len(found) > 1:
                return
            if layout[i][2] <= left:
                search(i + 1, left - layout[i][2], [*chosen, layout[i]])

    search(0, numel, [])
    if len(found) != 1:
        names = [name for name, _, _ in layout]
        raise RuntimeError(
            f"FSDP reduce-scatter output has {numel} elements, which {'no' if not found else 'more than one'} "
            f"subset of its group's parameters {names} makes up: cannot tell which gradients it holds"
        )
    return found[0]


def register_fsdp_comm_hook(
    model: nn.Module, state, *, reduction: str = "mean", step_end: str = "backward"
) -> FSDPCommHook:
    """Average the gradient shards of a `fully_shard`-ed model over ``state``'s process group.

    ``model`` is sharded on the shard mesh dimension only (a 1-D mesh, e.g. ``hsdp_mesh(k)["dp_shard"]``);
    ``state`` (an `EDGCState`, or `AllReduceState` for the uncompressed baseline) is built on the
    replicate group. Modules sharded on another mesh (experts on their expert-data-parallel mesh) take
    a state of their own: ``state`` is then ``{shard mesh: state on its replicate group}``, one per
    mesh. Call once, before the first backward; returns a handle with ``remove()``.

    ``reduction``: "mean" (FSDP's own contract: it divided the reduce-scatter by the shard count, and
    the replicas are averaged) or "sum", for a loop that turns FSDP's division off and scales the
    loss itself (torchtitan: ``set_gradient_divide_factor(1.0)``, the loss divided by the global
    token count): each shard is multiplied by the group's size before the state averages it, so the
    state's error feedback and factors hold the summed gradient. The sum is the native SUM
    all-reduce bit for bit during the warm-up where the group's size is a power of two (the raw
    average divides by it).

    ``step_end``: "backward" (one backward is one step, closed when it ends) or "caller", for a loop
    whose step runs several backward passes (torchtitan's chunked loss reduces its output layer's
    gradients in a backward of their own): the caller ends each step with ``hook.close_step()``, and a
    group's reduce-scatter holds the parameters that got gradients in that backward (FSDP's rule;
    `partial_layout`), every one of them once a step.
    """
    return FSDPCommHook(model, state, reduction, step_end)
