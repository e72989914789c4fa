"""EDGC inside torchtitan: the all-reduce between its data-parallel replicas compressed, one config name away.

    torchrun --nproc_per_node 4 -m torchtitan.train \\
        --module edgc.integrations.torchtitan --config llama3_debugmodel \\
        --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2 \\
        --parallelism.spmd_backend partial_dtensor --edgc.r_max 8 --edgc.window 100

``--module edgc.integrations.torchtitan --config NAME`` is torchtitan's config function ``NAME`` (any
of its models': ``llama3_debugmodel``, ``qwen3_…``, ``deepseek_v3_…``) trained by `EDGCTrainer`, and every
`EDGCConfig` field is a flag: ``--edgc.FIELD`` (the engine's ``--edgc.engine.FIELD``). In a config
registry of one's own: ``with_edgc(my_config())``. Read from torchtitan 0.3.0 (`torchtitan_adapter`).

What `EDGCTrainer` changes, and nothing else (no fork; no private member of torchtitan):

* **The FSDP mesh.** The model's parallelize function is called with a view of the parallel dims
  whose replicate axis is hidden (`torchtitan_adapter.ShardOnlyDims`): FSDP shards on the shard
  dimension alone and runs no replica all-reduce, and EDGC's FSDP hook (`edgc.parallel.fsdp`) does
  that all-reduce over ``parallel_dims.get_mesh("dp_replicate")``. torchtitan 0.3.0 has no
  ``replicate()`` path: ``apply_fsdp_to_decoder`` runs at every degree, so with
  ``data_parallel_shard_degree 1`` native torchtitan is HSDP with a shard of one rank (its hook
  receives the whole gradient), and with a replicate degree of 1 there is no replica all-reduce:
  EDGC says so and stays off.
* **The sum/scale contract.** torchtitan turns FSDP's division off (``set_gradient_divide_factor(1.0)``)
  and divides the loss by the global batch's token count, so the gradient reduction must be a SUM
  over every data-parallel rank: the reduce-scatter sums over the shard group, and the hook sums
  over the replicas (`edgc.distributed.scaling`'s "sum" convention, which the FSDP hook takes from
  FSDP's division: each shard times the replicate degree, experts included, then EDGC's average).
  Nothing is scaled twice: EDGC divides by nothing torchtitan divides by. During EDGC's warm-up the
  result is native HSDP's SUM all-reduce bit for bit where the replicate degree is a power of two;
  compressing, it is PowerSGD's approximation of that sum, with the error feedback in the same units.
* **The checkpoint.** EDGC's state is part of the trainer's own ``Stateful`` state (``train_state`` in
  torchtitan's checkpoint), one entry per global rank, ``train_state.edgc.rank<R>``, each rank's
  `EDGCState.state_dict` as bytes: DCP keeps one copy of what every rank saves under the same key (it
  takes it for replicated), and each rank's error feedback is its own. A resume loads this rank's
  entry back before the first step, and continues bit-exactly; the same world size is needed.

Gradient accumulation: torchtitan reduces every micro-batch's gradients, natively as here, so each
micro-batch is one EDGC step (``total_steps`` None: the run's steps × the accumulation steps).
Pipeline parallelism is refused (a stage's backward runs once per micro-batch), as are the
``full_dtensor`` and ``spmd_types`` backends (`torchtitan_adapter.check_backend`).
"""

from __future__ import annotations

import dataclasses
import io

import torch
import torch.distributed as dist

from ..config import EDGCConfig
from ..parallel import fsdp
from ..state import EDGCState
from . import torchtitan_adapter as adapter
from .torchtitan_adapter import TORCHTITAN_VERSION

try:
    from torchtitan.config.override import derive as _derive
    from torchtitan.tools.logging import logger
    from torchtitan.trainer import Trainer
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("edgc.integrations.torchtitan needs torchtitan: pip install 'edgc[torchtitan]'") from error

__all__ = ["EDGCTrainer", "with_edgc", "TORCHTITAN_VERSION"]


class EDGCTrainer(Trainer):
    """torchtitan's ``Trainer`` with EDGC on its replica all-reduce (the module docstring says what changes).

    ``edgc_states``: an `EDGCState` per shard mesh, ``"fsdp"`` (the dense parameters) and, with expert
    parallelism, ``"efsdp"`` (the routed experts, over their expert-data-parallel group), none with a
    replicate degree of 1; ``edgc_hook``: their `edgc.parallel.fsdp.FSDPCommHook`.

    Args:
        config: built by torchtitan: its ``Trainer.Config`` plus ``edgc``, EDGC's settings.

    Raises:
        ValueError: a replicate degree above 1 with pipeline parallelism, which EDGC does not support.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        edgc: EDGCConfig = dataclasses.field(default_factory=EDGCConfig)
        """EDGC's settings, every `EDGCConfig` field (``--edgc.r_max 8``; the engine's: ``--edgc.engine.seed 1``).
        ``total_steps`` None: the run's optimizer steps times its gradient accumulation steps."""

    edgc_states: dict[str, EDGCState]
    edgc_hook: fsdp.FSDPCommHook | None

    def __init__(self, config: Config):
        parallelism = config.parallelism
        if parallelism.data_parallel_replicate_degree > 1:
            adapter.check_backend(parallelism.spmd_backend)
            if parallelism.pipeline_parallel_degree > 1:
                raise ValueError(
                    "EDGC on torchtitan: pipeline parallelism is not supported (a stage's backward runs once per "
                    "micro-batch); drop --parallelism.pipeline_parallel_degree or EDGC"
                )
            spec = config.model_spec
            config.model_spec = dataclasses.replace(spec, parallelize_fn=adapter.shard_only(spec.parallelize_fn))
        self.edgc_states, self.edgc_hook = {}, None
        super().__init__(config)
        self.edgc_states, self.edgc_hook = self._start_edgc()

    @property
    def edgc_state(self) -> EDGCState | None:
        """The dense parameters' state (None with a replicate degree of 1)."""
        return self.edgc_states.get(adapter.DENSE)

    def _start_edgc(self) -> tuple[dict[str, EDGCState], fsdp.FSDPCommHook | None]:
        dims = self.parallel_dims
        if not dims.dp_replicate_enabled:
            logger.info("edgc: data_parallel_replicate_degree is 1, no replica all-reduce to compress: EDGC is off")
            return {}, None
        edgc = self.config.edgc
        if edgc.total_steps is None:
            edgc = dataclasses.replace(edgc, total_steps=self.config.training.steps * self.gradient_accumulation_steps)
        model = self.model_parts[0]
        meshes = adapter.shard_meshes(dims)  # the dense parameters' and, with EP, the routed experts'
        # no model=: each state learns its own parameters (and experts) from the hook's groups alone
        states = {name: EDGCState(dims.get_mesh("dp_replicate"), edgc) for name in meshes}
        # A step may run several backward passes (the chunked loss's output layer has its own): it ends
        # when forward_backward_step returns. The hook sums (FSDP's division is off).
        hook = fsdp.register_fsdp_comm_hook(model, {meshes[n]: states[n] for n in meshes}, step_end="caller")
        logger.info(
            f"edgc: on the replica all-reduce over {dims.dp_replicate} replicas ({', '.join(meshes)}), "
            f"{edgc.total_steps} steps"
        )
        return states, hook

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        """torchtitan's, then EDGC's step ends: its averages are in the gradients before they are clipped.

        Args:
            **kwargs: torchtitan's ``forward_backward_step``'s.

        Returns:
            The loss, as torchtitan's.
        """
        loss = super().forward_backward_step(**kwargs)
        if self.edgc_hook is not None:
            self.edgc_hook.close_step()
        return loss

    def state_dict(self) -> dict:
        """torchtitan's checkpoint state plus this rank's EDGC states, under ``"edgc"``.

        Returns:
            The state, for torchtitan's checkpointer.
        """
        state = super().state_dict()
        if self.edgc_states:
            buffer = io.BytesIO()
            torch.save({name: part.state_dict() for name, part in self.edgc_states.items()}, buffer)
            state["edgc"] = {_rank_key(): buffer.getvalue()}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torchtitan's, then this rank's EDGC states, from what `state_dict` returned.

        Args:
            state_dict: the checkpoint's state.

        Raises:
            ValueError: the checkpoint holds no EDGC state for this rank, or states of other meshes.
        """
        super().load_state_dict(state_dict)
        if not self.edgc_states:
            return
        saved = state_dict.get("edgc", {}).get(_rank_key())
        if not isinstance(saved, bytes):
            raise ValueError(f"edgc: the checkpoint holds no EDGC state for {_rank_key()} (saved without EDGC?)")
        parts = torch.load(io.BytesIO(saved), map_location="cpu", weights_only=True)  # state dicts: plain values
        if set(parts) != set(self.edgc_states):
            raise ValueError(
                f"edgc: the checkpoint holds EDGC states of {sorted(parts)}, this run {sorted(self.edgc_states)}"
            )
        for name, part in self.edgc_states.items():
            part.load_state_dict(parts[name])


def _rank_key() -> str:
    return f"rank{dist.get_rank()}"


def with_edgc(config: Trainer.Config, edgc: EDGCConfig | None = None) -> EDGCTrainer.Config:
    """torchtitan's ``config`` trained by `EDGCTrainer` with EDGC's settings: for a config registry of one's own.

    Args:
        config: a ``Trainer.Config``, as a config function returns it (or an `EDGCTrainer` one).
        edgc: EDGC's settings (default `EDGCConfig()`; for an `EDGCTrainer` config, None keeps its own).

    Returns:
        The `EDGCTrainer` config.

    Raises:
        TypeError: ``config`` belongs to another trainer than torchtitan's own.
    """
    if isinstance(config, EDGCTrainer.Config):
        return config if edgc is None else dataclasses.replace(config, edgc=edgc)
    if type(config) is not Trainer.Config:
        raise TypeError(
            f"with_edgc takes torchtitan's Trainer.Config; {type(config).__qualname__} belongs to another "
            "trainer, whose own fields EDGCTrainer would drop"
        )
    return _derive(config, EDGCTrainer.Config, edgc=edgc if edgc is not None else EDGCConfig())


def __getattr__(name: str):
    """``--module edgc.integrations.torchtitan --config NAME``: torchtitan's config function NAME, with EDGC."""
    base = None if name.startswith("_") else adapter.config_function(name, adapter.MODELS)
    if base is None:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r} (nor has any torchtitan model a config {name!r})"
        )

    def config_with_edgc() -> EDGCTrainer.Config:
        return with_edgc(base())

    config_with_edgc.__name__ = config_with_edgc.__qualname__ = name
    config_with_edgc.__doc__ = f"torchtitan's {base.__module__}.{name}, trained by EDGCTrainer."
    return config_with_edgc
