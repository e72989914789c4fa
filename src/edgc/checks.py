"""Checks of a config dataclass's fields, each failure one line naming the class and the field.

check = FieldCheck(self)             # in a config's __post_init__
check.integer("window", 1)           # ValueError: "EDGCConfig.window must be an integer ≥ 1, got 0"

The first check that fails raises its `ValueError`, so a config reports one bad field at a time.
"""

from __future__ import annotations

import math
from typing import Any


class FieldCheck:
    """Field checks of a config dataclass; each failure is one line naming the class and the field."""

    def __init__(self, config: Any):
        self.config = config
        self.owner = type(config).__name__

    def fail(self, name: str, requirement: str) -> None:
        raise ValueError(f"{self.owner}.{name} {requirement}, got {getattr(self.config, name)!r}")

    def integer(self, name: str, low: int) -> None:
        value = getattr(self.config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            self.fail(name, f"must be an integer ≥ {low}")

    def _finite(self, name: str) -> bool:
        value = getattr(self.config, name)
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    def ratio(self, name: str, low_open: bool) -> None:
        value = getattr(self.config, name)
        if not self._finite(name) or not (0 < value <= 1 if low_open else 0 <= value <= 1):
            self.fail(name, "must be in (0, 1]" if low_open else "must be in [0, 1]")

    def number(self, name: str, allow_zero: bool) -> None:
        value = getattr(self.config, name)
        if not self._finite(name) or value < 0 or (value == 0 and not allow_zero):
            self.fail(name, "must be a finite number ≥ 0" if allow_zero else "must be a finite number > 0")

    def boolean(self, name: str) -> None:
        if not isinstance(getattr(self.config, name), bool):
            self.fail(name, "must be True or False")

    def choice(self, name: str, choices: tuple) -> None:
        if getattr(self.config, name) not in choices:
            self.fail(name, f"must be one of {choices}")
