"""A part's result file of the GPU run, written as it goes: every row is on disk once measured, so a
part killed at its time limit (or the whole command at the device's) keeps what it had measured."""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path


def write_json(path: Path, data) -> None:
    """``data`` as JSON at ``path``, replaced whole (a kill mid-write leaves the file before it)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1, default=str))
    os.replace(partial, path)


class Record:
    """``out/<name>.json``: ``settings``, lists of rows by key (``add``), ``errors`` and ``unavailable``."""

    def __init__(self, out: Path, name: str, settings: dict):
        self.path = Path(out) / f"{name}.json"
        self.data = {"settings": settings, "errors": [], "unavailable": []}
        self.save()

    def save(self) -> None:
        write_json(self.path, self.data)

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.save()

    def add(self, key: str, row: dict) -> dict:
        self.data.setdefault(key, []).append(row)
        self.save()
        return row

    def attempt(self, key: str, what: dict, measure: Callable[[], dict]) -> dict | None:
        """``measure()``'s row with ``what`` in front, added under ``key``; None if it raised (the
        error recorded, the part goes on: each measurement is independent)."""
        try:
            row = {**what, **measure()}
        except Exception:  # noqa: BLE001 — the error is the result; the next measurement still runs
            self.data["errors"].append({**what, "key": key, "error": traceback.format_exc(limit=8)})
            self.save()
            print(f"{self.path.stem} {what}: failed\n{self.data['errors'][-1]['error']}", flush=True)
            return None
        print(self.path.stem, {k: v for k, v in row.items() if not isinstance(v, dict | list)}, flush=True)
        return self.add(key, row)

    def unavailable(self, key: str, what: dict, reason: str | None) -> bool:
        """Records that ``what`` cannot be measured in this build (``reason``); False if it can."""
        if reason is None:
            return False
        self.data["unavailable"].append({**what, "key": key, "reason": reason})
        self.save()
        print(f"{self.path.stem} {what}: {reason}", flush=True)
        return True
