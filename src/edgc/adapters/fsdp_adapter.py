"""The one place that reads FSDP2's private state: what EDGC's replica all-reduce hook (`edgc.parallel.fsdp`) needs of
``fully_shard`` that FSDP2 keeps private (torch 2.13).

FSDP2 offers ``FSDPModule.set_all_reduce_hook`` and no public view of the buffer its hook receives, so
these are read here, by name, and nowhere else:

* ``FSDPModule._get_fsdp_state()._fsdp_param_groups``: a module's parameter groups, whose
  ``fsdp_params`` (each with its ``sharded_size`` and padding) lay out the hook's flat buffer, the
  attributes ``foreach_reduce`` itself uses to view it.
* ``FSDPParamGroup._all_reduce_hook``: the hook ``foreach_reduce`` calls with that group's buffer, set
  per group (what ``FSDPModule.set_all_reduce_hook`` sets on each of a module's groups; it refuses a
  module with several groups, whose meshes differ, as one hook would not know which it was called
  for: each group's own hook does), and cleared on unregistering (FSDP2 has no call that removes it).
* ``FSDPParamGroup.gradient_divide_factor``: what ``FSDPModule.set_gradient_divide_factor`` set (None:
  FSDP's own division), which sets the gradient scale (`edgc.distributed.scaling`).
* ``FSDPParamGroup._orig_dtype``, ``._reduce_scatter_process_group`` and
  ``_fsdp_collectives._get_gradient_divide_factors``: whether FSDP2 reads the buffer again as soon as
  the hook returns (a cast, a division after the reduction), so that the hook must finish first; and
  ``_fsdp_common.FSDPMeshInfo``, the mesh kind that has a reduce-scatter group.
* a sharded parameter's ``_post_accumulate_grad_hooks``: a hook FSDP2 runs on the buffer after ours.
* ``FSDPParam._orig_size``: a parameter's unsharded size (a stacked experts parameter's rows).

Should FSDP2 rename one of them, this module is what changes.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo


def param_groups(module: FSDPModule) -> list:
    """The FSDP parameter groups of one ``fully_shard``-ed module."""
    return module._get_fsdp_state()._fsdp_param_groups


def set_all_reduce_hook(group, hook) -> None:
    """Set (None: clear) the all-reduce hook of one FSDP parameter group."""
    group._all_reduce_hook = hook


def divides(group) -> bool:
    """Whether FSDP divides the gradients of ``group`` itself (no ``set_gradient_divide_factor`` given)."""
    return group.gradient_divide_factor is None


def reads_buffer_after_hook(group, reduce_output: torch.Tensor) -> bool:
    """Whether FSDP2 reads the all-reduce hook's buffer as soon as the hook returns (`foreach_reduce`
    after the hook, torch 2.13): to cast it to the parameters' dtype, to divide it after the
    reduction, to add it to gradients already there, to copy it to the CPU, or for a
    post-accumulate-grad hook. Otherwise it only views it as the sharded gradients."""
    if group._orig_dtype is not None and group._orig_dtype != reduce_output.dtype:
        return True
    if isinstance(group.offload_policy, CPUOffloadPolicy):
        return True
    scatter_group = group._reduce_scatter_process_group if isinstance(group.mesh_info, FSDPMeshInfo) else None
    _, postdivide, _, _ = _get_gradient_divide_factors(
        scatter_group,
        None,
        reduce_output.dtype,
        reduce_output.device.type,
        group.gradient_divide_factor,
        group.force_sum_reduction_for_comms,
    )
    if postdivide not in (None, 1):
        return True
    return any(
        fp.sharded_param.grad is not None or getattr(fp.sharded_param, "_post_accumulate_grad_hooks", None)
        for fp in group.fsdp_params
    )


def unsharded_size(fsdp_param) -> torch.Size:
    """An FSDP parameter's size before sharding."""
    return fsdp_param._orig_size
