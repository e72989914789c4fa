"""Registries by name: the budget signals, the rank mappings and the sync methods are each one.

A registry maps a name to one entry, in registration order; a name is registered once, and asking
for one it does not hold fails with one line that lists what it holds. Registering is process-wide
(a plug-in registers at import), but a state takes what its config names when it is built, so a
registration never changes a state that exists.
"""

from __future__ import annotations

from typing import Generic, TypeVar

Entry = TypeVar("Entry")


class Registry(dict, Generic[Entry]):
    """Entries of one ``kind`` (its name in messages: "budget signal", …), keyed by name."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def add(self, name: str, entry: Entry) -> Entry:
        """Register ``entry`` as ``name`` (non-empty, not yet registered); returns it."""
        if not name or name in self:
            raise ValueError(f"{self.kind} name {name!r} is empty or already registered")
        self[name] = entry
        return entry

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self)

    def find(self, name: str) -> Entry:
        """The entry registered as ``name``; ValueError naming the registered ones if there is none."""
        if name not in self:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self)}")
        return self[name]
