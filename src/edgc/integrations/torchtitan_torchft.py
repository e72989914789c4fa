"""EDGC inside torchtitan's torchft experiment: the compressed hook across replica groups, in place of its
plain all-reduce, through torchft's manager (`edgc.integrations.torchft`: uncommitted steps, heal).

    torchrun --nproc_per_node 2 -m torchtitan.train \\
        --module edgc.integrations.torchtitan_torchft --config llama3_torchft_debugmodel \\
        --fault_tolerance.enable --fault_tolerance.replica_id 0 --fault_tolerance.group_size 2 \\
        --fault_tolerance.process_group gloo --checkpoint.enable --edgc.r_max 8   # one per replica group

``--config NAME`` is the torchft experiment's config function NAME (``llama3_torchft_debugmodel``)
trained by `EDGCFaultTolerantTrainer`; every `EDGCConfig` field is a flag, ``--edgc.FIELD``. In a
registry of one's own: ``with_edgc_torchft(my_config())``. Read from torchtitan 0.3.0.

torchtitan's torchft experiment syncs every step with a plain hook (``semi_sync_method`` None):
FSDP shards inside each replica group and, per FSDP group, all-reduces the reduce-scatter output
with AVG over torchft's managed process group (each group's loss is divided by its own token
count, so the mean over groups is the gradient). `EDGCTorchFTManager` installs EDGC's FSDP hook
there instead, on a `TorchFTEDGCState`: every collective through the manager, a step the manager
does not commit rolled back (its gradient kept as error feedback), and a group that restarts heals
its shared EDGC state (step, Q, rank schedule, controller) from a live peer with the model.

What differs from torchtitan's own manager: torchft's quorum is synchronous (a healing group must
hold the quorum's rank before the step's first collective; torchtitan makes it so only for a
semi-sync method, so the manager is built as for one) while the per-step machinery stays the one of
the plain hook (the optimizer wrapper starts the quorum and asks for the commit every step; the
loss is averaged over the groups). EDGC's state is not in torchtitan's persistent checkpoint here:
the groups' state travels by healing, and each group's error feedback stays its own.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import EDGCConfig
from ..parallel import fsdp
from . import torchtitan_adapter as adapter
from .torchft import TorchFTEDGCState
from .torchtitan_adapter import TORCHTITAN_VERSION

try:
    from torchft import process_group as torchft_groups
    from torchtitan.config.override import derive as _derive
    from torchtitan.experiments.torchft.config.job_config import FaultTolerance
    from torchtitan.experiments.torchft.manager import TorchFTManager
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("edgc.integrations.torchtitan_torchft needs pip install 'edgc[torchtitan,torchft]'") from error

__all__ = ["EDGCFaultTolerantTrainer", "EDGCTorchFTManager", "with_edgc_torchft", "TORCHTITAN_VERSION"]

# torchtitan's TorchFTManager makes torchft's quorum synchronous when a semi-sync method is named; the
# name it is built with here is read by nothing else (the trainer's own config keeps None).
_SYNC_QUORUM = "edgc (a synchronous quorum, a sync every step)"


class EDGCTorchFTManager(TorchFTManager):
    """torchtitan's ``TorchFTManager`` whose all-reduce hook is EDGC's (the module docstring).

    Once the trainer has called `maybe_set_all_reduce_hook`: ``edgc_state`` (a `TorchFTEDGCState`) and
    ``edgc_hook``.

    Args:
        config: torchtitan's ``--fault_tolerance`` settings; ``semi_sync_method`` must be None.

    Raises:
        ValueError: fault tolerance is on with a ``semi_sync_method``.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(FaultTolerance):
        pass

    def __init__(self, config: Config):
        if config.enable and config.semi_sync_method is not None:
            raise ValueError(
                f"EDGC syncs every step: --fault_tolerance.semi_sync_method must be None, got "
                f"{config.semi_sync_method!r} (DiLoCo with EDGC's outer sync: edgc.integrations.torchft.DiLoCo)"
            )
        super().__init__(dataclasses.replace(config, semi_sync_method=_SYNC_QUORUM) if config.enable else config)
        self.edgc_config = EDGCConfig()
        self.edgc_state: TorchFTEDGCState | None = None
        self.edgc_hook: fsdp.FSDPCommHook | None = None
        if self.enabled:
            # torchtitan's meaning of the flag: the optimizer wrapper starts the quorum and asks for the
            # commit every step, and the loss is averaged over the replica groups.
            self.use_async_quorum = True
            self.replicate_pg = torchft_groups.ManagedProcessGroup(self.manager)
            self.replicate_pg.register("dp_replicate")

    def maybe_set_all_reduce_hook(self, model_parts: list[torch.nn.Module]) -> None:
        """Register EDGC's hook (``edgc_state``, ``edgc_hook``) on the model, where fault tolerance is on.

        Args:
            model_parts: torchtitan's model parts; one, as EDGC runs without pipeline parallelism.

        Raises:
            ValueError: more than one model part (pipeline parallelism).
        """
        if not self.enabled:
            return
        if len(model_parts) != 1:
            raise ValueError("EDGC on torchtitan: pipeline parallelism is not supported; drop it or EDGC")
        model = model_parts[0]
        self.edgc_state = TorchFTEDGCState(self.manager, self.edgc_config)  # its parameters: the hook's
        # AVG over the groups, as torchtitan's own hook (each group's loss is divided by its own tokens,
        # FSDP's division off); a step ends when forward_backward_step returns
        self.edgc_hook = fsdp.register_fsdp_comm_hook(model, self.edgc_state, step_end="caller", scale="mean")


class EDGCFaultTolerantTrainer(FaultTolerantTrainer):
    """torchtitan's ``FaultTolerantTrainer`` with EDGC across its replica groups (`EDGCTorchFTManager`).

    torchtitan builds it from ``config``: its config plus ``edgc``, EDGC's settings.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(FaultTolerantTrainer.Config):
        fault_tolerance: EDGCTorchFTManager.Config = dataclasses.field(default_factory=EDGCTorchFTManager.Config)
        edgc: EDGCConfig = dataclasses.field(default_factory=EDGCConfig)
        """EDGC's settings, every `EDGCConfig` field (``--edgc.r_max 8``); ``total_steps`` None: the run's steps."""

    def init_distributed(self):
        """torchtitan's, then the manager is given EDGC's settings (``total_steps`` None: the run's steps).

        Returns:
            torchtitan's parallel dimensions.
        """
        dims = super().init_distributed()
        edgc = self.config.edgc
        if edgc.total_steps is None:
            edgc = dataclasses.replace(edgc, total_steps=self.config.training.steps)
        self.ft_manager.edgc_config = edgc
        return dims

    @property
    def edgc_state(self) -> TorchFTEDGCState | None:
        return self.ft_manager.edgc_state

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        """torchtitan's, then EDGC's step ends: its averages are in the gradients before they are clipped.

        Args:
            **kwargs: torchtitan's ``forward_backward_step``'s.

        Returns:
            The loss, as torchtitan's.
        """
        loss = super().forward_backward_step(**kwargs)
        if self.ft_manager.edgc_hook is not None:
            self.ft_manager.edgc_hook.close_step()
        return loss


def with_edgc_torchft(config: FaultTolerantTrainer.Config, edgc: EDGCConfig | None = None):
    """The torchft experiment's ``config`` trained by `EDGCFaultTolerantTrainer`, syncing every step.

    Args:
        config: the experiment's ``FaultTolerantTrainer.Config``.
        edgc: EDGC's settings (default `EDGCConfig()`).

    Returns:
        The `EDGCFaultTolerantTrainer` config, its ``semi_sync_method`` set to None.

    Raises:
        TypeError: ``config`` is not a ``FaultTolerantTrainer.Config``.
    """
    if type(config) is not FaultTolerantTrainer.Config:
        raise TypeError(f"with_edgc_torchft takes FaultTolerantTrainer.Config, got {type(config).__qualname__}")
    fault_tolerance = _derive(config.fault_tolerance, EDGCTorchFTManager.Config, semi_sync_method=None)
    return _derive(
        config,
        EDGCFaultTolerantTrainer.Config,
        fault_tolerance=fault_tolerance,
        edgc=edgc if edgc is not None else EDGCConfig(),
    )


def __getattr__(name: str):
    """``--module edgc.integrations.torchtitan_torchft --config NAME``: the torchft experiment's NAME, with EDGC."""
    base = None if name.startswith("_") else adapter.config_function(name, adapter.TORCHFT_MODELS)
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (nor a torchft experiment's config)")

    def config_with_edgc():
        return with_edgc_torchft(base())

    config_with_edgc.__name__ = config_with_edgc.__qualname__ = name
    config_with_edgc.__doc__ = f"torchtitan's {base.__module__}.{name}, trained by EDGCFaultTolerantTrainer."
    return config_with_edgc
