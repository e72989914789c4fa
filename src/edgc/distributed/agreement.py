"""The settings every rank of a group must hold alike, compared once, before anything depends on them.

A setting that shapes a collective or a decision and differs between ranks fails late or not at
all: with ``r_max`` 4 on one rank and 8 on another, each chooses its own rank and the factors'
all-reduce mismatches in size (gloo aborts the process: ``op.preamble.length <= op.nbytes``); with
``rank_budget`` 4 and 8, rank 0's decides for all and nobody is told. The replica fingerprint
(`edgc.safeguards.fingerprint`) sees the state only at a window's end, after such a setting was used.

So at a state's first step (`edgc.safeguards.guards.UsageGuard.first_use`), before it plans the step or sends
anything, the ranks compare its settings (`GradientReducer.agreed_settings`: the method, its own
arguments, every `EDGCConfig` field, the values ``"auto"`` and None resolve to on this device, and
what an integration adds with `GradientReducer.agree_on`: DiLoCo's ``sync_every`` and fragments,
the FSDP mesh's shard) in one all-reduce of 2 × `SLOTS` int64 (2 KiB):

* slot 0 holds a 62-bit BLAKE2b hash of the sorted setting names (another sync method, an
  integration on some ranks only), slots 1… one hash of each setting's name and value, in name
  order (those past the last slot share it);
* each rank sends every hash h as h and −h, summed by MAX: every rank gets each slot's largest and
  smallest hash, and where they differ, the setting differs (a collision of 62-bit hashes aside).

Where a slot differs, every rank finds the same first one, and one all-gather of a fixed-size text
(each rank's value of that setting, or its setting names) lets every rank raise the same one line,
`SettingsDiffer`, naming the setting and each value with the global ranks holding it. That second
collective runs only on a mismatch. The fingerprint goes on checking the shared state every window.
Neither is the step's gradient traffic (not in its collectives or bytes).

Not compared: a state under torchft's manager (its replicas join and leave; the fingerprint still
runs), and a state without a process group or alone in one.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from ..device import timing
from ..device.timing import to_device
from .comm import Communicator

SLOTS = 128
TEXT_BYTES = 4096  # of each rank's text in the all-gather that names a difference
SHOWN = 120  # characters of a value shown in the message

__all__ = ["SettingsDiffer", "agree", "SLOTS"]


class SettingsDiffer(RuntimeError):
    """A setting that every rank of a group must hold alike differs between them (`edgc.distributed.agreement`)."""


def setting_hash(name: str, value: Any) -> int:
    """A 62-bit hash of a setting's name and value (the value's ``repr``): the same in every process."""
    digest = hashlib.blake2b(f"{name}={value!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def _slots(settings: dict[str, Any]) -> tuple[list[int], list[str]]:
    """The slot hashes and the setting names they stand for (slot 0: the names themselves)."""
    names = sorted(settings)
    hashes = [setting_hash("setting names", names)] + [setting_hash(name, settings[name]) for name in names]
    if len(hashes) > SLOTS:  # the last slot stands for every setting from there on
        hashes[SLOTS - 1 :] = [setting_hash("rest", [(name, settings[name]) for name in names[SLOTS - 2 :]])]
    return hashes + [0] * (SLOTS - len(hashes)), names


def agree(comm: Communicator, owner: str, settings: dict[str, Any], device: torch.device, ranks: list[int]) -> None:
    """Compare ``settings`` over ``comm``'s group (every rank calls it at the same point); raise
    `SettingsDiffer` on every rank where one differs. ``owner`` names the state in the message,
    ``ranks`` are the group's global ranks, ``device`` the one its collectives take."""
    if not comm.issues or comm.world_size < 2:
        return
    hashes, names = _slots(settings)
    mine = to_device(torch.tensor(hashes, dtype=torch.int64), device)
    both = torch.cat([mine, -mine])
    issued_before = comm.mark()
    comm.all_reduce(both, op=dist.ReduceOp.MAX)
    values = timing.to_host(both)  # once, at the first step: the library's read (`edgc.device.timing`)
    differs = [slot for slot in range(SLOTS) if values[slot] != -values[SLOTS + slot]]
    if not differs:
        comm.forget_since(*issued_before)
        return
    slot = differs[0]
    if slot == 0:  # the method first: where it differs, that is the difference to name
        text = "\n".join([repr(settings.get("method")), *names])
    elif slot < SLOTS - 1 or len(names) < SLOTS - 1:
        text = repr(settings[names[slot - 1]])
    else:
        text = repr([(name, settings[name]) for name in names[SLOTS - 2 :]])
    texts = _gathered(comm, text, device)
    comm.forget_since(*issued_before)
    if slot == 0:
        methods = [text.split("\n")[0] for text in texts]
        if len(set(methods)) > 1:
            raise SettingsDiffer(_differs("edgc", "method", methods, ranks))  # the owners differ too
        raise SettingsDiffer(_kinds_differ(owner, [set(t.split("\n")[1:]) for t in texts], ranks))
    name = names[slot - 1] if slot < SLOTS - 1 or len(names) < SLOTS - 1 else f"one of {names[SLOTS - 2 :]}"
    raise SettingsDiffer(_differs(owner, name, texts, ranks))


def _differs(owner: str, name: str, texts: list[str], ranks: list[int]) -> str:
    return (
        f"{owner}: setting {name} differs across its group ({_holders(texts, ranks)}): give every rank "
        "the same (it shapes a collective or a decision; checked before anything was sent)"
    )


def _gathered(comm: Communicator, text: str, device: torch.device) -> list[str]:
    """Every rank's ``text`` (cut to `TEXT_BYTES`), in group-rank order."""
    data = text.encode()[:TEXT_BYTES]
    buffer = torch.zeros(TEXT_BYTES + 4, dtype=torch.uint8)
    buffer[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    buffer[4 : 4 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    texts = []
    for part in comm.all_gather(to_device(buffer, device)):
        values = timing.to_host(part)
        size = int.from_bytes(bytes(values[:4]), "little")
        texts.append(bytes(values[4 : 4 + size]).decode(errors="replace"))
    return texts


def _on(ranks: list[int]) -> str:
    return f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _holders(texts: list[str], ranks: list[int]) -> str:
    """'4 on rank 0, 8 on ranks 1, 2': each value once, with the global ranks holding it."""
    by_value: dict[str, list[int]] = {}
    for text, rank in zip(texts, ranks):
        by_value.setdefault(text, []).append(rank)
    shown = {text if len(text) <= SHOWN else text[: SHOWN - 1] + "…": holders for text, holders in by_value.items()}
    return ", ".join(f"{text} {_on(holders)}" for text, holders in shown.items())


def _kinds_differ(owner: str, held: list[set[str]], ranks: list[int]) -> str:
    """The settings some ranks hold and others do not (the first five), with the ranks holding each."""
    some = sorted(name for name in set.union(*held) if not all(name in names for names in held))
    parts = [f"{name} ({_on([rank for names, rank in zip(held, ranks) if name in names])})" for name in some[:5]]
    more = f" and {len(some) - 5} more" if len(some) > 5 else ""
    return (
        f"{owner}: the ranks of its group hold different settings, {', '.join(parts)}{more} only: give every "
        "rank the same sync method and integrations (checked before anything was sent)"
    )
