"""`EDGCDDPStrategy`: Lightning's DDPStrategy that registers the EDGC hook on any device.

    from edgc.integrations.lightning import EDGCDDPStrategy
    trainer = Trainer(accelerator="cpu", devices=2, strategy=EDGCDDPStrategy(EDGCConfig(r_max=8)))

Why not ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``: Lightning (checked on
pytorch-lightning 2.6.6) registers the hook only when the root device is CUDA, and on any other
device trains uncompressed without a warning. This subclass registers it whatever the device.

The EDGC state is built inside each training process once DDP has wrapped the model, because
Lightning starts the processes and the process group itself: a state built beforehand in the
launching script would see a world of one process. It is ``strategy.comm_state`` afterwards
(``.last_step_metrics``, ``.totals``, ``.state_dict()``). Any other hook (``ddp_comm_hook=`` and
``ddp_comm_state=``, e.g. PyTorch's own) is also registered on every device. Extra keyword
arguments go to DDPStrategy and from there to DistributedDataParallel (``static_graph``,
``find_unused_parameters``, ``bucket_cap_mb``, …).

Works with ``pytorch_lightning`` or the unified ``lightning`` package (whichever is installed;
``make_strategy_class(lightning.pytorch.strategies.DDPStrategy)`` picks one explicitly).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from ..config import EDGCConfig
from ..runner.reducer import GradientReducer, edgc_hook
from ..state import EDGCState
from . import check_group


def make_strategy_class(base: type) -> type:
    """An EDGC-registering subclass of the given Lightning ``DDPStrategy`` class.

    Args:
        base: Lightning's ``DDPStrategy``, from ``pytorch_lightning`` or ``lightning.pytorch``.

    Returns:
        The subclass, `EDGCDDPStrategy` over ``base``.
    """

    class EDGCDDPStrategy(base):  # type: ignore[misc, valid-type]
        """Lightning's ``DDPStrategy`` that registers a comm hook on any device (see the module docstring).

        Give at most one of ``config``, ``state_factory`` and ``ddp_comm_hook``. The state is
        `comm_state` once training starts.

        Args:
            config: the `EDGCConfig` of the `EDGCState` built in each process once DDP wraps the model
                (the default: ``EDGCConfig()``).
            state_factory: a function of the DDP model that returns any `GradientReducer`.
            ddp_comm_state: the state of ``ddp_comm_hook``.
            ddp_comm_hook: any other hook (PyTorch's own), registered on every device.
            ddp_comm_wrapper: wraps the hook, as in ``DDPStrategy``.
            **kwargs: go to ``DDPStrategy`` (and from there to DistributedDataParallel).

        Raises:
            ValueError: more than one of ``config``, ``state_factory`` and ``ddp_comm_hook``, or a
                ``ddp_comm_state`` without its hook.
            TypeError: ``config`` is not an `EDGCConfig`.
        """

        def __init__(
            self,
            config: EDGCConfig | None = None,
            *,
            state_factory: Callable[[Any], GradientReducer] | None = None,
            ddp_comm_state: object | None = None,
            ddp_comm_hook: Callable | None = None,
            ddp_comm_wrapper: Callable | None = None,
            **kwargs: Any,
        ) -> None:
            given = sum(x is not None for x in (config, state_factory, ddp_comm_hook))
            if given > 1:
                raise ValueError("give one of config, state_factory or ddp_comm_hook")
            if config is not None and not isinstance(config, EDGCConfig):
                raise TypeError(f"config must be an EDGCConfig, got {type(config).__name__}")
            if ddp_comm_hook is None and ddp_comm_state is not None:
                raise ValueError("ddp_comm_state needs ddp_comm_hook (or pass config / state_factory)")
            super().__init__(
                ddp_comm_state=ddp_comm_state, ddp_comm_hook=ddp_comm_hook, ddp_comm_wrapper=ddp_comm_wrapper, **kwargs
            )
            if given == 0:
                config = EDGCConfig()
            self.edgc_config = config
            self._state_factory = state_factory

        @property
        def comm_state(self) -> object | None:
            """The registered hook's state (the EDGCState), once training has started."""
            return self._ddp_comm_state

        def _register_ddp_hooks(self) -> None:  # Lightning's version returns unless on CUDA
            if self._ddp_comm_hook is None:
                if self._state_factory is not None:
                    state = self._state_factory(self.model)
                else:  # a copy per strategy, so one config object can serve several runs
                    state = EDGCState(None, copy.deepcopy(self.edgc_config), model=self.model)
                self._ddp_comm_state, self._ddp_comm_hook = state, edgc_hook
            check_group(self._ddp_comm_state)
            hook = self._ddp_comm_hook
            if self._ddp_comm_wrapper is not None:
                hook = self._ddp_comm_wrapper(hook)
            self.model.register_comm_hook(self._ddp_comm_state, hook)

    EDGCDDPStrategy.__qualname__ = EDGCDDPStrategy.__name__
    return EDGCDDPStrategy


def _default_base() -> type:
    try:
        from pytorch_lightning.strategies import DDPStrategy
    except ImportError:
        try:
            from lightning.pytorch.strategies import DDPStrategy
        except ImportError:
            raise ImportError(
                "edgc.integrations.lightning needs Lightning: pip install 'edgc[integrations]' (pytorch-lightning)"
            ) from None
    return DDPStrategy


EDGCDDPStrategy = make_strategy_class(_default_base())

__all__ = ["EDGCDDPStrategy", "make_strategy_class"]
