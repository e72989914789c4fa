"""The runs of `edgc experiment pareto` (pareto.py): the data prepared once, what makes two runs the
same (their key: setting, seed and resolved config), earlier runs reused by key, and the pool the
new ones run in."""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

from . import common
from .pareto_train import compressor_fields, train_run


def prepare_data_once(setting) -> None:
    from edgc_train.data import DataError, prepare_data

    cfg = setting.train_config()
    try:
        prepare_data(cfg.data, cfg.vocab_size, cfg.val_fraction, cfg.max_chars, cfg.cache_dir, log=lambda _: None)
    except DataError as exc:
        raise common.CLIError(str(exc)) from None


def resolved_config(fields: dict) -> dict:
    """An arm's whole compressor config: its fields over `EDGCConfig`'s defaults (and the
    instrument's own ``cold_start``). Run keys hold this, so a changed default is a different run."""
    from edgc import EDGCConfig

    config = EDGCConfig.from_dict(compressor_fields(fields)).to_dict()
    if fields.get("cold_start"):
        config["cold_start"] = True
    if fields.get("shadow_ranks"):
        config["shadow_ranks"] = list(fields["shadow_ranks"])
    if fields.get("shadow_twin"):
        config["shadow_twin"] = fields["shadow_twin"]
    return config


def run_key(setting: dict, config: dict, seed: int) -> str:
    """What makes two runs the same run: the training setting, the seed and the resolved config."""
    return json.dumps({"setting": setting, "seed": seed, "config": config}, sort_keys=True, default=list)


def reusable_runs(folders: list[str], log=print) -> dict[str, dict]:
    """{run key: record} of the finished runs in earlier pareto folders (runs/*.json, or a results.json).

    Records whose key holds only an arm's explicit fields (written before keys held the resolved
    config) are not reused: under which defaults they ran is not recorded. A key whose config has the
    engine's fields flat (written before they were nested) is read as its nested equal."""
    from edgc.config import nested_config_dict

    found, older = {}, 0
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise common.CLIError(f"--reuse: {folder} is not a folder")
        for path in sorted(folder.glob("runs/*.json")):
            record = json.loads(path.read_text())
            key = json.loads(record["key"])
            if "config" not in key:
                older += 1
                continue
            record["key"] = run_key(key["setting"], nested_config_dict(key["config"]), key["seed"])
            found[record["key"]] = record
        summary = folder / "results.json"
        if summary.is_file():  # a finished experiment: the keys follow from its setting, configs and seeds
            data = json.loads(summary.read_text())
            if "configs" not in data:
                older += sum(len(by_seed) for runs_b in data["runs"].values() for by_seed in runs_b.values())
                continue
            for b, configs_b in data["configs"].items():
                for name, config in configs_b.items():
                    for seed, result in data["runs"][b][name].items():
                        key = run_key(data["setting"], nested_config_dict(config), int(seed))
                        found.setdefault(key, {"key": key, "result": result})
    if older:
        log(f"  --reuse: {older} records from before run keys held the whole config are not reused")
    return found


class InProcess:
    """``--jobs 1``: the runs one after the other in this process (no worker start-up)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @staticmethod
    def submit(fn, *args):
        future = Future()
        future.set_result(fn(*args))
        return future


def executor(jobs: int):
    if jobs == 1:
        return InProcess()
    return ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))


def run_one(job):
    setting, fields, seed = job
    return train_run(setting, fields, seed)
