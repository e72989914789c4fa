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

Every parameter group is sharded on a 1-D mesh (its shard dimension): with a 2-D mesh FSDP runs its
own replica all-reduce before the hook, and there would be nothing left to compress. A module may hold
several groups, each on a mesh of its own (``fully_shard(block, shard_placement_fn=…)`` returning a
``ShardPlacementResult`` with another mesh, as torchtitan shards an MoE block's experts on their
expert-FSDP mesh and the rest on the dense one): each group gets a hook of its own (FSDP2's public
``set_all_reduce_hook`` refuses such modules, as one hook would not know the group; `fsdp_adapter` sets
each group's), and each group's shards are averaged over the replicate group that goes with its mesh,
by the state given for that mesh (``{shard mesh: state}``). A 2-D expert mesh ``[dp_replicate, efsdp]``
is given as its two halves: FSDP shards on ``efsdp``, the experts' state averages over ``dp_replicate``.
A group on a mesh without a state is refused in one line (`mesh_refusal`); so is a state whose group
holds other shards of a module (built on the shard mesh, or on the default group). Which shard each
rank of the state's group holds is compared before the first step sends anything (`edgc.distributed.agreement`).

**FSDP's division** sets the gradient scale (`edgc.distributed.scaling`, the contract): where FSDP divides
(its default: by the shard mesh's size) the states average over their replicate groups, the experts'
gradients scaled by 1/ep; where the division is off (``set_gradient_divide_factor`` set, torchtitan's
1.0 with its loss divided by the global tokens) FSDP's division is the user's whole scaling and the
states sum over their replicate groups, experts included. The groups one state averages must agree on
it, and it must not change once the hook is registered: either is refused in one line.

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
from dataclasses import replace

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
from ..distributed.scaling import MEAN, SUM
from ..runner.reducer import GradientReducer
from ..safeguards.guards import group_ranks
from .fsdp_layout import partial_layout, shard_layout

__all__ = ["hsdp_mesh", "register_fsdp_comm_hook", "FSDPCommHook", "shard_layout", "mesh_refusal", "partial_layout"]

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


def _sharded_groups(model: nn.Module) -> list[tuple[str, FSDPModule, object]]:
    """(name, module, parameter group) of every parameter group with parameters of every `fully_shard`-ed
    module, in ``model.modules()`` order (a module's groups in FSDP's order; a group that several modules
    share, ``fully_shard([a, b])``, once); a group on a 2-D mesh is refused."""
    found, seen = [], set()
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in fsdp_adapter.param_groups(module):
            if not group.fsdp_params or id(group) in seen:
                continue
            seen.add(id(group))
            if group.mesh_info.replicate_mesh_dim is not None:  # native HSDP or replicate()
                raise ValueError(
                    "shard the model on 1-D meshes (e.g. hsdp_mesh(k)['dp_shard'], a 2-D expert mesh's 'efsdp'): "
                    "on a 2-D mesh FSDP all-reduces over the replicas itself before any hook runs"
                )
            found.append((f"module {name!r}" if name else "the model", module, group))
    return found


class FSDPCommHook:
    """The all-reduce hooks of one `fully_shard`-ed model; made by `register_fsdp_comm_hook`. ``states``:
    one state, or a state per shard mesh ({mesh: state}), each parameter group's shards averaged by its mesh's.
    ``step_end`` ("backward": a backward is a step; "caller": `close_step` ends it) and ``scale``:
    `register_fsdp_comm_hook`'s."""

    def __init__(self, model: nn.Module, states, step_end: str = "backward", scale: str | None = None):
        if step_end not in STEP_ENDS:
            raise ValueError(f"register_fsdp_comm_hook: step_end must be one of {STEP_ENDS}, got {step_end!r}")
        if scale not in (None, MEAN, SUM):
            raise ValueError(f"register_fsdp_comm_hook: scale must be None, {MEAN!r} or {SUM!r}, got {scale!r}")
        self.step_end = step_end
        if not isinstance(model, FSDPModule):
            raise TypeError("register_fsdp_comm_hook needs a model that fully_shard was applied to")
        sharded = _sharded_groups(model)
        if not sharded:
            raise ValueError("the model has no parameters to reduce")
        routes = _routes(states, sharded[0][2].mesh_info.mesh)
        chosen = [_route(name, group.mesh_info.mesh, routes) for name, _, group in sharded]  # all refused first
        self.states = [state for _, state in routes]
        self.state = self.states[0]
        self.model = model
        divides = _division(sharded, chosen)
        names = {id(p): name for name, p in model.named_parameters()}
        marks = expert_marks(model)
        self._groups = []  # (module, group, [(name, size, padded numel)])
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
            self._groups.append((module, group, layout))
            fsdp_adapter.set_all_reduce_hook(group, self._make_hook(layout, group, state, divides[id(state)]))
        if step_end == "backward":
            # Every parameter that requires a gradient enters every reduce-scatter (a zero gradient when
            # unused, as in DDP), so the buffer layout, and the tensors sent, are the same every step.
            model.set_reduce_scatter_unused_params(True)
        for mesh, state in routes:
            # Checkpoint checks compare error feedback with this rank's shards, not the full parameters.
            state.parameter_shapes = shapes[state]
            state.follow_fsdp(model, scale or (MEAN if divides[id(state)] else SUM))
            # The ranks of the state's group must hold the same shard: compared before anything is sent.
            shard_ranks = dist.get_process_group_ranks(mesh.get_group())
            state.agree_on({"FSDP shard": f"{shard_ranks.index(dist.get_rank())} of {len(shard_ranks)}"})
        self._open: list[GradientReducer] = []  # the states whose step this backward opened, in order
        self._reduced: dict[GradientReducer, set[str]] = {}  # step_end="caller": what this step reduced so far
        self._held = {state: set(shapes[state]) for state in self.states}  # the parameters each state reduces

    def _make_hook(self, layout, group, state: GradientReducer, divides: bool):
        # Padding: each shard occupies its padded numel; the trailing padding of the last shards is
        # not a gradient and is neither sent nor compressed.
        expected = sum(padded for _, _, padded in layout)
        partial: dict[int, list] = {}  # a reduce-scatter's numel → the parameters it holds (step_end="caller")

        def hook(reduce_output: torch.Tensor) -> None:
            if fsdp_adapter.divides(group) != divides:
                raise RuntimeError(
                    "FSDP's gradient division was changed after register_fsdp_comm_hook, which set the "
                    "gradient scale from it (edgc.distributed.scaling): set it before registering"
                )
            held, numel = layout, reduce_output.numel()
            if numel != expected:
                if self.step_end != "caller":
                    raise RuntimeError(
                        f"FSDP reduce-scatter output has {numel} elements, the layout "
                        f"{expected}: parameters without requires_grad changed since registering?"
                    )
                held = partial[numel] if numel in partial else partial.setdefault(numel, partial_layout(layout, numel))
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
            missing = sorted(self._held[state] - self._reduced.get(state, set()))
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
        for _, group, _ in self._groups:
            fsdp_adapter.set_all_reduce_hook(group, None)
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


def _division(sharded, chosen) -> dict[int, bool]:
    """id(state) → whether FSDP divides the gradients of the groups it averages (`edgc.distributed.scaling`);
    a state whose groups differ in it is refused."""
    divides: dict[int, bool] = {}
    for (name, _, group), (_, state) in zip(sharded, chosen):
        mode = fsdp_adapter.divides(group)
        if divides.setdefault(id(state), mode) != mode:
            raise ValueError(
                f"register_fsdp_comm_hook: {name}'s FSDP {'divides' if mode else 'does not divide'} its gradients "
                "and another group of the same state's mesh the other way: one state averages or sums "
                "(edgc.distributed.scaling); set_gradient_divide_factor alike on every module"
            )
    return divides


def _expert_route(name: str, mark: ExpertMark, mesh: DeviceMesh, state: GradientReducer) -> ExpertMark:
    """The mark of an experts parameter as its state sees it (averaged over the state's group, the shard
    mesh reducing over the rest), or its refusal: a marked one whose expert-data-parallel group is not the
    state's group times its shard mesh, a found one whose EP ranks those cover twice, one split over
    ranks no one named."""
    comm = state.comm
    if type(comm) is not Communicator or not comm.issues:
        return mark
    state_ranks, shard_ranks = group_ranks(comm), dist.get_process_group_ranks(mesh.get_group())
    covered = set(state_ranks) | set(shard_ranks)
    if mark.unknown is not None:
        raise ValueError(
            f"register_fsdp_comm_hook: {name} {mark.unknown}: say its expert-data-parallel group with "
            "edgc.distributed.experts.mark_experts(module, group, first=…, ep=…)"
        )
    if mark.ranks is None:
        wrong = mark.ep_ranks is not None and len(covered & set(mark.ep_ranks)) > 1
    else:
        wrong = len(set(mark.ranks)) != len(state_ranks) * len(shard_ranks) or not covered <= set(mark.ranks)
    if wrong:
        described = f"{list(mark.ranks)}" if mark.ranks is not None else f"outside its EP ranks {list(mark.ep_ranks)}"
        raise ValueError(
            f"register_fsdp_comm_hook: {name} holds experts averaged over global ranks {described}, but "
            f"its state averages over {state_ranks} and its shard mesh over {shard_ranks}: give the experts' "
            "mesh a state on the replicate group of their expert-data-parallel ranks"
        )
    return replace(mark, ranks=tuple(state_ranks))


def _first_row(fsdp_param, mark: ExpertMark, mesh: DeviceMesh) -> int:
    """The global expert index of this rank's first row of a stacked experts parameter: its mark's first,
    plus the rows of the shards before it when FSDP shards the experts themselves (dim 0)."""
    placement = getattr(fsdp_param, "fsdp_placement", None)
    if mesh.size() == 1 or getattr(placement, "dim", 0) != 0:
        return mark.first  # every row of this rank's experts (a Shard(1) shard: a slice of each)
    rows = fsdp_adapter.unsharded_size(fsdp_param)[0]
    return mark.first + mesh.get_local_rank() * -(-rows // mesh.size())


def register_fsdp_comm_hook(
    model: nn.Module, state, *, step_end: str = "backward", scale: str | None = None
) -> FSDPCommHook:
    """Average the gradient shards of a `fully_shard`-ed model over ``state``'s process group.

    ``model`` is sharded on the shard mesh dimension only (a 1-D mesh, e.g. ``hsdp_mesh(k)["dp_shard"]``);
    ``state`` (an `EDGCState`, or `AllReduceState` for the uncompressed baseline) is built on the
    replicate group. Modules sharded on another mesh (experts on their expert-data-parallel mesh) take
    a state of their own: ``state`` is then ``{shard mesh: state on its replicate group}``, one per
    mesh. Call once, before the first backward; returns a handle with ``remove()``.

    ``step_end``: "backward" (one backward is one step, closed when it ends) or "caller", for a loop
    whose step runs several backward passes (torchtitan's chunked loss reduces its output layer's
    gradients in a backward of their own): the caller ends each step with ``hook.close_step()``, and a
    group's reduce-scatter holds the parameters that got gradients in that backward (FSDP's rule;
    `partial_layout`), every one of them once a step.

    ``scale``: the gradient scale's convention (`edgc.distributed.scaling`): None, FSDP's division decides
    (its default: "mean"; turned off: "sum"), or "mean"/"sum" where the loop's loss says otherwise —
    torchtitan's torchft experiment turns the division off and divides each replica group's loss by that
    group's own tokens, so its groups are averaged ("mean").
    """
    return FSDPCommHook(model, state, step_end, scale)
