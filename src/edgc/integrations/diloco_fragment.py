"""A DiLoCo model fragment (`edgc.integrations.diloco`): its parameters, their global values θ_global and
its outer optimizer; θ_global and the fragment's pseudo-gradients Δ as one flat buffer each."""

from __future__ import annotations

import torch
from torch import nn, optim

from ..device import streams
from ..device.timing import host_reads_allowed, state_to_host


class Fragment:
    """One model fragment: its parameters, their global values θ_global (the backup) and its outer optimizer.

    The backup is in host memory (pinned on CUDA) unless ``backup_device`` says otherwise. Copies
    to and from it are queued on the compute stream without a host wait (``non_blocking``: from
    pinned memory the copy is asynchronous, from pageable memory CUDA makes it safe by waiting),
    in stream order with everything that reads them; the host touches it only after an event that
    follows the last of them (a checkpoint, a heal).

    Args:
        index: the fragment's place among its DiLoCo's, which prefixes its parameters' names.
        module: the fragment's module.
        outer_optimizer: its outer optimizer.
        backup_device: where θ_global is kept (None: host memory).
        pin_memory: pin the host backup where the parameters' device can use pinned memory.
    """

    def __init__(
        self,
        index: int,
        module: nn.Module,
        outer_optimizer: optim.Optimizer,
        backup_device: torch.device | None,
        pin_memory: bool,
    ):
        self.index, self.module, self.outer_optimizer = index, module, outer_optimizer
        named = list(module.named_parameters())
        self.names = [f"{index}.{name}" for name, _ in named]
        self.params = [p for _, p in named]
        on_host = backup_device is None or torch.device(backup_device).type == "cpu"
        pin = on_host and pin_memory and bool(self.params) and streams.pins(self.params[0].device)
        where = {"pin_memory": pin} if on_host else {"device": backup_device}
        # One flat buffer when the parameters share a dtype and a device (θ_global and Δ: one copy each
        # way, and Δ one run for the sync); else a tensor each.
        self.flat = bool(self.params) and len({(p.dtype, p.device) for p in self.params}) == 1
        if self.flat:
            self.flat_original = torch.empty(sum(p.numel() for p in self.params), dtype=self.params[0].dtype, **where)
            self.original = _views(self.flat_original, self.params)
        else:
            self.original = [torch.empty(p.shape, dtype=p.dtype, **where) for p in self.params]
        self.deltas: list[torch.Tensor] = []  # this outer step's Δ, averaged in place by the sync
        self.kept: list[torch.Tensor] = []  # the local Δ as sent, while the step may still be discarded
        self._last_copy = None  # an event after the last queued copy to or from the backup (None off CUDA)
        self.save()

    def copied(self) -> None:
        """Copies to or from the backup were just queued on the compute stream."""
        if self.params:
            self._last_copy = streams.current_stream(self.params[0].device).record_event()

    def _idle(self) -> None:
        """Wait until no queued copy reads or writes the backup (before the host does)."""
        if self._last_copy is not None:
            with host_reads_allowed():  # a checkpoint or a heal: not a step
                self._last_copy.synchronize()

    @torch.no_grad()
    def pseudo_gradients(self) -> list[torch.Tensor]:
        """Δ = θ_global − θ_local of every parameter, in the parameters' dtype and on their device.

        Returns:
            Δ per parameter, in the parameters' order; views of one flat buffer where the backup is one.
        """
        params = [p.detach() for p in self.params]
        if not self.flat:
            return [backup.to(p.device, p.dtype, non_blocking=True) - p for backup, p in zip(self.original, params)]
        flat = torch.empty(self.flat_original.shape, dtype=params[0].dtype, device=params[0].device)
        flat.copy_(self.flat_original, non_blocking=True)
        deltas = _views(flat, params)
        torch._foreach_sub_(deltas, params)
        return deltas

    @torch.no_grad()
    def save(self) -> None:
        """θ_global ← the parameters."""
        for backup, p in zip(self.original, self.params):
            backup.copy_(p.detach(), non_blocking=True)
        self.copied()

    @torch.no_grad()
    def restore(self) -> None:
        """The parameters ← θ_global."""
        for backup, p in zip(self.original, self.params):
            p.copy_(backup, non_blocking=True)
        self.copied()

    def state_dict(self) -> dict:
        """θ_global on the host and the outer optimizer's state, once no queued copy touches the backup.

        Returns:
            The state, for `load_state_dict`.
        """
        self._idle()
        original = state_to_host(dict(enumerate(self.original)))
        return {"original": list(original.values()), "outer_optimizer": self.outer_optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore θ_global and the outer optimizer from what `state_dict` returned.

        Args:
            state: a fragment's state with as many parameters.

        Raises:
            ValueError: ``state`` holds another number of parameters.
        """
        if len(state["original"]) != len(self.original):
            raise ValueError(
                f"DiLoCo fragment {self.index}: the state has {len(state['original'])} parameters, "
                f"the fragment {len(self.original)}"
            )
        self._idle()
        with torch.no_grad():
            for backup, saved in zip(self.original, state["original"]):
                backup.copy_(saved)
        with host_reads_allowed():  # torch's optimizer moves its loaded state with blocking copies: a resume
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into views shaped as the tensors of ``like``, end to end."""
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in like]), like)]
