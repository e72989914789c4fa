"""What one dispatched ATen op costs a GPU beyond its launch: how many kernels, how many bytes.

`edgc_probes.dispatch_count.DispatchCounter` applies both to every kernel-launching dispatch. The
bytes are those of a kernel that touches each element once: every input tensor read once (a GEMM's
operands included), every output written once. Caches, a GEMM's re-reads of its small operand and
a broadcast's repeats are not modelled; what is counted is what a pass over memory must move.
"""

from __future__ import annotations

import math

import torch

from edgc.adapters import torch_adapter

aten = torch.ops.aten


def kernels_per_dispatch(func: torch._ops.OpOverload, args: tuple, out=None) -> int:
    """1, except for a ``cat`` or ``stack`` (`cat_kernels`; ``out``: its result) and a ``_foreach_*`` op on
    lists of mixed dtypes: CUDA's multi-tensor kernels need one dtype across the lists (``_foreach_copy_``:
    one per list), so PyTorch runs such a call tensor by tensor (``foreach_tensor_*_slow_``), one kernel
    per tensor (ATen's ForeachUtils.h)."""
    if func.overloadpacket in (aten.cat, aten.stack) and isinstance(out, torch.Tensor):
        return cat_kernels(list(args[0]), out)
    if not func.overloadpacket.__name__.startswith("_foreach_"):
        return 1
    lists = [arg for arg in args if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor)]
    if not lists:
        return 1
    if func.overloadpacket is aten._foreach_copy_:
        mixed = any(len({t.dtype for t in tensors}) > 1 for tensors in lists)
    else:
        mixed = len({t.dtype for tensors in lists for t in tensors}) > 1
    return len(lists[0]) if mixed else 1


# Gathers: they read the elements their index names (as many as they write), not their whole input.
GATHERS = frozenset({aten.index_select, aten.take, aten.gather})

# Ops that overwrite a mutable argument without reading it (their destination counts as written only).
OVERWRITES = frozenset({aten.copy_, aten._foreach_copy_, aten.zero_, aten._foreach_zero_, aten.fill_})


def tensors_in(value) -> list[torch.Tensor]:
    """The tensors of an op's argument or result: itself, or those in a (nested) list, tuple or dict."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    return []


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def op_traffic(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out) -> tuple[int, int]:
    """(bytes read, bytes written) of one dispatch, as a kernel that touches every element once would
    move them: each input tensor read once (a GEMM's operands included; a broadcast input at its own
    size; a gather's input only where its index points), each output written once. A mutable argument
    (``add_``'s self) is read and written, an ``out=`` argument only written, as is the destination of
    `OVERWRITES`; new outputs are written."""
    read = written = 0
    gathered = func.overloadpacket in GATHERS
    for position, argument in enumerate(torch_adapter.op_schema(func).arguments):
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        size = _nbytes(value)
        if gathered and argument.name == "self":  # the elements gathered, at the input's element size
            size = sum(t.numel() for t in tensors_in(out)) * value.element_size()
        if argument.is_out:
            written += size
        elif argument.alias_info is not None and argument.alias_info.is_write:
            written += size
            read += 0 if func.overloadpacket in OVERWRITES else size
        else:
            read += size
    if not any(r.alias_info is not None for r in torch_adapter.op_schema(func).returns):
        written += _nbytes(out)
    return read, written


CAT_BATCH = 128  # inputs per launch of CUDA's batched cat copy (CAT_ARRAY_BATCH_SIZE); half where one is strided
CAT_MAX_DIMS = 4  # CAT_ARRAY_MAX_INPUT_DIMS
INT32_MAX = 2**31 - 1


def _indexes_in_32_bits(tensor: torch.Tensor) -> bool:
    """ATen's ``canUse32BitIndexMath``: the tensor's elements and its last element's offset fit in an int32."""
    if tensor.numel() >= INT32_MAX:
        return False
    return sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size) < INT32_MAX


def cat_kernels(inputs: list[torch.Tensor], out: torch.Tensor) -> int:
    """The copy kernels CUDA launches for ``torch.cat(inputs)`` into ``out`` (ATen's ``cat_out_cuda``,
    cuda/Shape.cu, torch 2.11 to 2.13): with more than one input, at most 4 dimensions, 32-bit offsets
    and every input of ``out``'s dtype, one batched copy per 128 inputs (when all are contiguous) or
    per 64 (when one is strided); else one copy per non-empty input (``out.narrow(…).copy_(input)``),
    as for a gather of strided bf16 views into fp32. A ``stack`` is a ``cat`` of its inputs unsqueezed:
    the same kernels. Nothing for an empty output."""
    if out.numel() == 0:
        return 0
    kept = [t for t in inputs if not (t.dim() == 1 and t.numel() == 0)]  # cat_should_skip_tensor
    batched = (
        len(inputs) > 1
        and out.dim() <= CAT_MAX_DIMS
        and all(t.dtype == out.dtype for t in inputs)
        and all(_indexes_in_32_bits(t) for t in [out, *inputs])
    )
    if not batched:
        return sum(1 for t in kept if t.numel())
    contiguous = out.is_contiguous() and len(kept) == len(inputs) and all(t.is_contiguous() for t in kept)
    return max(1, math.ceil(len(kept) / (CAT_BATCH if contiguous else CAT_BATCH // 2)))
