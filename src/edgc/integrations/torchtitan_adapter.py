"""The one place that knows how torchtitan builds its data parallelism: what `edgc.integrations.torchtitan`
relies on of torchtitan, read from torchtitan 0.3.0 (``TORCHTITAN_VERSION``), and nowhere else.

No private member of torchtitan is read. What is relied on is the shape of its parallelize functions
(``ModelSpec.parallelize_fn``, public), in 0.3.0's ``models/{llama3,qwen3,deepseek_v3,…}/parallelize.py``
under the ``partial_dtensor`` backend: the dense parameters are sharded on
``parallel_dims.get_mesh(["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"])``
and the routed experts likewise on ``["dp_replicate", "efsdp"]`` or ``["efsdp"]``. With
``dp_replicate_enabled`` False they are sharded on the shard dimension only, whatever the replicate
degree: FSDP then runs no replica all-reduce of its own, and the all-reduce hook receives each
group's reduce-scatter output, un-averaged over the replicas (with a 2-D mesh, native HSDP,
``foreach_reduce`` all-reduces over the replicas before it calls the hook). `ShardOnlyDims` is that
view. The ``full_dtensor`` and ``spmd_types`` backends shard on the storage mesh, which holds the
replicate axis whatever ``dp_replicate_enabled`` says: they are refused (`check_backend`).

Should a new torchtitan choose its FSDP mesh otherwise, `edgc.parallel.fsdp.register_fsdp_comm_hook`
refuses the 2-D mesh in one line (nothing trains silently uncompressed), and this module is what changes.
"""

from __future__ import annotations

import importlib

TORCHTITAN_VERSION = "0.3.0"
MODELS = "torchtitan.models"  # its models' packages, each with a config_registry module
TORCHFT_MODELS = "torchtitan.experiments.torchft"  # the models of its torchft experiment, likewise
DENSE, EXPERTS = "fsdp", "efsdp"  # the shard meshes of the dense parameters and of the routed experts
SHARD_ONLY_BACKENDS = ("partial_dtensor",)


class ShardOnlyDims:
    """A view of torchtitan's ``ParallelDims`` that says ``dp_replicate_enabled`` is False and is the
    original in every other respect: handed to a parallelize function, the model is sharded on the
    shard dimension (``fsdp``, ``efsdp``) alone. ``dims``: the trainer's ``ParallelDims``."""

    def __init__(self, dims):
        self._dims = dims

    @property
    def dp_replicate_enabled(self) -> bool:
        return False

    def __getattr__(self, name: str):
        return getattr(self._dims, name)


def shard_only(parallelize_fn):
    """``parallelize_fn`` (a ``ModelSpec.parallelize_fn``) called with `ShardOnlyDims`."""

    def parallelize_on_shard_mesh(model, *, parallel_dims, **kwargs):
        return parallelize_fn(model, parallel_dims=ShardOnlyDims(parallel_dims), **kwargs)

    parallelize_on_shard_mesh.__name__ = f"shard_only({getattr(parallelize_fn, '__name__', 'parallelize')})"
    return parallelize_on_shard_mesh


def check_backend(spmd_backend: str) -> None:
    """Refuse, in one line, a DTensor backend whose FSDP mesh keeps the replicate axis (module docstring)."""
    if spmd_backend not in SHARD_ONLY_BACKENDS:
        raise ValueError(
            f"EDGC on torchtitan {TORCHTITAN_VERSION} needs --parallelism.spmd_backend partial_dtensor "
            f"(got {spmd_backend!r}): under the other backends FSDP shards on the storage mesh, replicate "
            "axis included, and all-reduces over the replicas before any hook runs"
        )


def config_function(name: str, package: str):
    """torchtitan's config function ``name``, from the config registry of the model its name starts with
    (``deepseek_v3_debugmodel`` → ``torchtitan.models.deepseek_v3.config_registry``, the longest such
    model name first) in ``package``; None where there is none."""
    parts = name.split("_")
    for end in range(len(parts) - 1, 0, -1):
        module_name = f"{package}.{'_'.join(parts[:end])}.config_registry"
        try:
            registry = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and module_name.startswith(error.name):
                continue  # no such model
            raise
        function = getattr(registry, name, None)
        if callable(function):
            return function
    return None


def shard_meshes(dims) -> dict:
    """The meshes `ShardOnlyDims` makes FSDP shard on: ``DENSE`` always, ``EXPERTS`` with expert
    parallelism (the routed experts' FSDP mesh, whose replicas are their expert-data-parallel group)."""
    names = (DENSE, EXPERTS) if dims.ep_enabled else (DENSE,)
    return {name: dims.get_mesh(name) for name in names}
