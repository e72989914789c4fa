"""A GPU run's files (`python -m edgc_bench.gpu --out DIR`) as scripts/to_docs.py gpu reads them: each
file of the folder, the rows a figure is read from, and the cells it is shown in (before → after)."""

from __future__ import annotations

import json
from pathlib import Path

from doc_blocks import ROOT

GIB = 2**30
GOAL_RATIO, GOAL_SHARE = 0.5, 0.05  # the GPU goals: EDGC ≤ 0.5× powerSGD_hook, ≤ 5 % of backward
DASH = "–"


# ---------------------------------------------------------------------------- reading
def read_json(folder: Path, name: str):
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def load_run(folder: Path) -> dict:
    """A run's files; engine.json in one shape (the first run wrote a list of training-step rows)."""
    engine = read_json(folder, "engine") or {}
    if isinstance(engine, list):
        engine = {"steps": [dict(row, bucket_cap_mb=25, ddp_default=True) for row in engine]}
    engine = {"settings": {}, "steps": [], "hook_alone": [], "skipped": [], "errors": [], **engine}
    traces = [folder / f"trace_{key}.json.gz" for key in ("nccl", "gloo")]
    return {
        "folder": folder,
        "env": read_json(folder, "env") or {},
        "engine": engine,
        "overlap": read_json(folder, "overlap") or {},
        "device": read_json(folder, "device"),
        "count": read_json(folder, "count"),
        "trace": next((path for path in traces if path.exists()), None),
    }


def goal_rank(run: dict) -> int:
    return run["engine"]["settings"].get("goal_rank", 32)


SIZES = ("tiny", "small", "medium", "large", "xl")


def by_size(key: tuple) -> tuple:
    """Sort key of rows keyed by (model, …): GPT-2's sizes in order, then the rest of the key."""
    return (SIZES.index(key[0]) if key[0] in SIZES else len(SIZES), *key[1:])


def largest(run: dict) -> str | None:
    models = {(row["model"],) for row in run["engine"]["steps"] + run["engine"]["hook_alone"]}
    return max(models, key=by_size)[0] if models else None


def step_row(run: dict, model: str, method: str, rank: int, cap=25) -> dict | None:
    return next(
        (
            r
            for r in run["engine"]["steps"]
            if (r["model"], r["method"], r.get("rank"), r["bucket_cap_mb"])
            == (model, method, rank if method != "none" else 0, cap)
        ),
        None,
    )


def alone_row(run: dict, model: str, method: str, dtype: str, rank: int, cap=25) -> dict | None:
    return next(
        (
            r
            for r in run["engine"]["hook_alone"]
            if (r["model"], r["method"], r["grad_dtype"], r["rank"], r["bucket_cap_mb"])
            == (model, method, dtype, rank, cap)
        ),
        None,
    )


def count_row(run: dict | None, model: str, cap) -> dict | None:
    if run is None or not run["count"] or "hook" not in run["count"]:
        return None
    return next((r for r in run["count"]["hook"] if (r["model"], r["bucket_cap_mb"]) == (model, cap)), None)


# ---------------------------------------------------------------------------- formatting
def fmt(value, spec: str = ".3g", scale: float = 1.0) -> str:
    return DASH if value is None else format(value * scale if scale != 1 else value, spec)


def cell(run: dict, before: dict | None, find, key: str, spec: str = ".3g", scale: float = 1.0) -> str:
    """``find(run)[key]``, as ``before → after`` where there is a before run."""
    after = fmt(get(find(run), key), spec, scale)
    return after if before is None else f"{fmt(get(find(before), key), spec, scale)} → {after}"


def get(row: dict | None, key: str, default=None):
    return default if row is None else row.get(key, default)


def ratio(a, b):
    return None if a is None or not b else a / b


def verdict(value, goal: float, unit: str, spec: str) -> str:
    if value is None:
        return "not measured"
    if value <= goal:
        return f"met: {format(value, spec)}{unit} (goal ≤ {format(goal, spec)}{unit})"
    return f"missed: {format(value, spec)}{unit}, {value / goal:.1f}× the goal of ≤ {format(goal, spec)}{unit}"


# ---------------------------------------------------------------------------- sections
def shown(folder: Path) -> str:
    """A run folder as the docs name it: relative to the repository when inside it."""
    try:
        return str(folder.resolve().relative_to(ROOT))
    except ValueError:
        return str(folder)


def describe(run: dict, role: str) -> str:
    env = run["env"]
    return (
        f"- {role}: `{shown(run['folder'])}`: {env.get('device', '?')} ({env.get('nvidia_smi', 'no nvidia-smi')}), "
        "torch "
        f"{env.get('torch', '?')}, CUDA {env.get('cuda', DASH)}, NCCL {env.get('nccl', DASH)}, {env.get('date', '?')}."
    )


def markdown_table(titles: list[str], align: str, rows: list[list[str]]) -> list[str]:
    """A table's lines; ``align`` has one letter per column: l(eft) or r(ight)."""
    rule = "|" + "".join(" --- |" if side == "l" else " ---: |" for side in align)
    return ["| " + " | ".join(titles) + " |", rule, *("| " + " | ".join(row) + " |" for row in rows)]
