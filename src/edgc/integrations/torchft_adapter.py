"""The one place that reads torchft's private members: what EDGC needs of torchft that torchft keeps private.

torchft (0.1–0.2) offers no public way to these, so each is read here, by name, and nowhere else:

* ``Manager._pg``: the quorum's process group. The manager offers only all-reduce; the two-stage
  sync's all-to-all and all-gather run on this group directly, and so does an all-reduce that keeps
  in step with peers after a reported error (`edgc.integrations.torchft_managed`). Its ``parent``
  tells this replica's place among the group's members, spares included.
* ``Manager._timeout``: the manager's timeout, given to the collectives issued on ``_pg`` directly.
* ``Manager._quorum_future``: whether a quorum was started; before it, the manager cannot say the
  quorum's size.
* ``Manager._use_async_quorum``: a healing replica must load the shared state before the step's first
  collective, which an asynchronous quorum does not wait for: EDGC refuses it.
* ``DiLoCo._fragments``, ``._sync_every``, ``._local_step`` and a fragment's ``_model_fragment``
  (``torchft.local_sgd``): the bench and experiments read where an outer step stands and which
  parameters a fragment holds. EDGC's own DiLoCo (`edgc.integrations.diloco`) keeps the same names,
  so that one reading serves both.

Should torchft rename one of them, this module is what changes.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch import nn


def process_group(manager: Any) -> Any:
    """The quorum's process group (``Manager._pg``)."""
    return manager._pg


def timeout(manager: Any) -> timedelta:
    """The manager's timeout (``Manager._timeout``)."""
    return manager._timeout


def quorum_started(manager: Any) -> bool:
    """A quorum was started (``Manager._quorum_future``): its size and this replica's place can be asked."""
    return getattr(manager, "_quorum_future", None) is not None


def uses_async_quorum(manager: Any) -> bool:
    """The manager was built with ``use_async_quorum=True`` (``Manager._use_async_quorum``)."""
    return bool(getattr(manager, "_use_async_quorum", False))


def fragments(diloco: Any) -> list:
    """A DiLoCo's fragments, torchft's or EDGC's (``_fragments``)."""
    return diloco._fragments


def fragment_module(fragment: Any) -> nn.Module:
    """The module a torchft DiLoCo fragment syncs (``_model_fragment``)."""
    return fragment._model_fragment


def sync_every(diloco: Any) -> int:
    """Inner steps between two outer steps, one fragment's each (``_sync_every``)."""
    return diloco._sync_every


def local_step(diloco: Any) -> int:
    """Inner steps taken since the last outer step (``_local_step``)."""
    return diloco._local_step


def set_local_step(diloco: Any, step: int) -> None:
    """Set the inner steps since the last outer step (``_local_step``): a run that starts at an outer step."""
    diloco._local_step = step
