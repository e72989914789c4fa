"""The one `DeviceMesh` of a run: every process group of a 3D-parallel job comes from it.

    mesh = init_parallel_mesh(model, pp=2, tp=2)                  # on the model's device; dp_replicate = the rest
    parallelize_module(block, mesh["tp"], plan)                    # DTensor tensor parallelism
    fully_shard(model, mesh=mesh["dp_shard"])                      # FSDP2 on the shard dimension
    state = EDGCState(mesh["dp_replicate"], EDGCConfig(...))       # EDGC over the replicas
    aligner = StageAligner(state, stage, stages, mesh["pp"], tp_group=mesh["tp"])
    # with TP, the stage's TP shards decide alike: EDGCState(..., decision_group=group_across(mesh, ("dp_replicate",
    # "tp")))

Dimensions ``MESH_DIMS`` = (dp_replicate, pp, dp_shard, ep, tp), as torchtitan names them; any may be 1.
The order is the rank layout, outermost first: TP ranks are consecutive, then the expert-parallel
ranks, then the FSDP shards, then the pipeline stages, so a host (``torchrun --nproc_per_node
pp·dp_shard·ep·tp``) holds whole pipelines and its experts' all-to-all, and the replicas, whose
gradient all-reduce EDGC compresses, are on different hosts. (torchtitan puts pp outermost, with
pipelines across hosts; here the slow link is the replicas'.)

Expert parallelism borrows its ranks from data parallelism, as in torchtitan: a dense parameter is
replicated over dp_replicate × dp_shard × ep (its data-parallel group, `group_across` those three),
an expert over dp_replicate × dp_shard only (its expert-data-parallel group: ``mesh["dp_replicate"]``
when dp_shard is 1), and the ep ranks hold different experts (`edgc.distributed.experts`).

Wherever the library takes a process group it also takes a 1-D mesh (a dimension such as
``mesh["dp_replicate"]``), resolved by `as_process_group`. The mesh has no dimension for the tied
embedding of a pipeline (stage 0 and stage P−1 of one pipeline), nor for several dimensions at
once (a stage's DP × TP ranks, who take EDGC's decisions together): `pipeline_ends_group` and
`group_across` build those, the only places in the code that call ``new_group``.
"""

from __future__ import annotations

import itertools
import math
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..adapters import torch_adapter

__all__ = [
    "MESH_DIMS",
    "init_parallel_mesh",
    "mesh_device_type",
    "as_process_group",
    "pipeline_ends_group",
    "group_across",
    "local_tensor",
    "is_dtensor",
]

MESH_DIMS = ("dp_replicate", "pp", "dp_shard", "ep", "tp")


def _backend_options(timeout: timedelta | None) -> dict | None:
    """Per-dimension backend options carrying ``timeout`` (the mesh's groups otherwise get c10d's
    default, 30 minutes on gloo, instead of the default group's)."""
    if timeout is None:
        return None
    backend = dist.get_backend()
    options = torch_adapter.backend_options(backend, timeout)
    if options is None:  # another backend: its own default timeout
        return None
    return {name: (backend, options) for name in MESH_DIMS}


def mesh_device_type(device=None) -> str:
    """The device type of a mesh for ``device``: a model (its parameters' device), a tensor, a device or
    its name. None: the accelerator the default process group runs collectives on (CUDA under NCCL),
    else ``cpu``. It matters: FSDP2 moves a model to its mesh's device (a CUDA model sharded on a
    ``cpu`` mesh goes to the CPU, where NCCL then rejects it)."""
    if isinstance(device, nn.Module):
        device = next(itertools.chain(device.parameters(), device.buffers()), None)
    if isinstance(device, torch.Tensor):
        return device.device.type
    if device is not None:
        return torch.device(device).type
    if dist.is_initialized() and torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator().type
        backend = dist.Backend.default_device_backend_map.get(accelerator)
        if backend is not None and backend in str(dist.get_backend()):
            return accelerator
    return "cpu"


def init_parallel_mesh(
    device=None,
    *,
    pp: int = 1,
    dp_shard: int = 1,
    tp: int = 1,
    dp_replicate: int | None = None,
    timeout: timedelta | None = None,
    ep: int = 1,
) -> DeviceMesh:
    """The 5-D mesh ``MESH_DIMS`` over all ranks; ``dp_replicate`` defaults to the rest of the world.

    ``device``: the model (or its device) the mesh is for (`mesh_device_type`).
    Collective: every rank calls it with the same arguments. ``timeout`` applies to every group."""
    world = dist.get_world_size()
    inner = pp * dp_shard * ep * tp
    if min(pp, dp_shard, ep, tp) < 1 or world % inner:
        raise ValueError(f"mesh: pp {pp} × dp_shard {dp_shard} × ep {ep} × tp {tp} must divide the world size {world}")
    if dp_replicate is None:
        dp_replicate = world // inner
    if dp_replicate * inner != world:
        raise ValueError(
            f"mesh: dp_replicate {dp_replicate} × pp {pp} × dp_shard {dp_shard} × ep {ep} × tp {tp} is not the world "
            f"size {world}"
        )
    return init_device_mesh(
        mesh_device_type(device),
        (dp_replicate, pp, dp_shard, ep, tp),
        mesh_dim_names=MESH_DIMS,
        backend_override=_backend_options(timeout),
    )


def as_process_group(group):
    """The process group for what the library accepts in its place: a group, None (the default
    group), or a 1-D `DeviceMesh`, e.g. ``mesh["dp_replicate"]``."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"a {group.ndim}-D mesh ({group.mesh_dim_names}) is not one group: pass one "
                "dimension, e.g. mesh['dp_replicate']"
            )
        return group.get_group()
    return group


def pipeline_ends_group(mesh: DeviceMesh, dim: str = "pp", timeout: timedelta | None = None):
    """The group of the first and the last rank along ``dim`` through this rank (stage 0 and stage
    P−1 of one pipeline: the copies of a tied embedding); None on the ranks in between and when
    ``dim`` has size 1. With 2 stages it is the ``dim`` group itself. Collective over all ranks."""
    size = mesh.size(mesh.mesh_dim_names.index(dim))
    if size == 1:
        return None
    if size == 2:
        return mesh.get_group(dim)
    axis = mesh.mesh_dim_names.index(dim)
    pairs = mesh.mesh.movedim(axis, -1).reshape(-1, size)[:, [0, size - 1]].tolist()
    rank, mine = dist.get_rank(), None
    for pair in pairs:  # every rank creates every group, in the same order
        group = dist.new_group(pair, timeout=timeout)
        if rank in pair:
            mine = group
    return mine


def group_across(mesh: DeviceMesh, dims: tuple[str, ...], timeout: timedelta | None = None):
    """The group of the ranks that share this rank's coordinates in every dimension but ``dims``:
    e.g. ``("dp_replicate", "tp")``, a pipeline stage's DP replicas of all its TP shards. Collective
    over all ranks (each creates every such group, in the same order)."""
    axes = [mesh.mesh_dim_names.index(dim) for dim in dims]
    others = [axis for axis in range(mesh.ndim) if axis not in axes]
    size = math.prod(mesh.size(axis) for axis in axes)
    rows = mesh.mesh.permute(*others, *axes).reshape(-1, size).tolist()
    rank, mine = dist.get_rank(), None
    for row in rows:
        group = dist.new_group(row, timeout=timeout)
        if rank in row:
            mine = group
    return mine


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writing it writes the DTensor), or the tensor itself.
    EDGC compresses a tensor-parallel parameter's gradient shard by shard, each over its DP group."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a DTensor. Reads the class off an already-imported
    ``torch.distributed.tensor`` rather than importing it here (about a second of CPU in every
    process, most of ``import edgc``): no DTensor can exist before that module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)
