"""Atomic, verified checkpoints.

Layout of ``RUN_DIR/checkpoints/step_XXXXXX/`` (XXXXXX = optimizer steps done, zero-padded):

- ``model.pt``, ``optimizer.pt``, ``scheduler.pt``: written by rank 0 (DDP keeps them identical).
- ``trainer.json``: step, wall-clock offset, world size and the config fields a resume must match.
- ``rank{R}.pt`` per rank: that rank's RNG states (torch, cuda, numpy, python) and data-sampler position.
- ``edgc_rank{R}.pt`` per rank: that rank's compressor state (EDGC error feedback, Q factors, rank
  schedule, entropy series, ...), which differs between ranks.
- ``manifest.json`` (written last): sha256 and size of every file above.

Atomicity: all ranks write into ``.step_XXXXXX.tmp/`` (each file itself via temp name + fsync +
rename), then rank 0 writes the manifest and renames the folder to its final name and fsyncs the
parent. A folder named ``step_*`` therefore always holds a complete checkpoint; a crash leaves only a
``.tmp`` folder, which resume ignores. Several hosts need a shared filesystem for ``RUN_DIR``.

Loading verifies every file against the manifest first and names the first bad one.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(ValueError):
    """A missing, corrupt or mismatched checkpoint; the CLI reports it as one line."""


# ---------------------------------------------------------------------- atomic file writes
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_torch_save(obj: Any, path: Path) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------- RNG state
def rng_state() -> dict:
    """Every RNG the training loop may touch, for this process."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


# ---------------------------------------------------------------------- paths
def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint folder (``.tmp`` leftovers of a crash are not candidates)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return max(found)[1] if found else None


# ---------------------------------------------------------------------- save
def save_rank_files(tmp_dir: Path, rank: int, sampler_state: dict, compressor_state: Any) -> None:
    """This rank's share of a checkpoint (every rank calls it, before the barrier)."""
    atomic_torch_save({"rng": rng_state(), "sampler": sampler_state}, tmp_dir / f"rank{rank}.pt")
    atomic_torch_save(compressor_state, tmp_dir / f"edgc_rank{rank}.pt")


def save_model_shard(tmp_dir: Path, shard: str, model_sd: dict, optimizer_sd: dict) -> None:
    """Model and optimizer of one shard: "" for data parallel, "_stage{s}" for pipeline stage s."""
    atomic_torch_save(model_sd, tmp_dir / f"model{shard}.pt")
    atomic_torch_save(optimizer_sd, tmp_dir / f"optimizer{shard}.pt")


def save_trainer_files(tmp_dir: Path, scheduler_sd: dict, trainer: dict) -> None:
    """LR scheduler and trainer.json (global rank 0)."""
    atomic_torch_save(scheduler_sd, tmp_dir / "scheduler.pt")
    atomic_write_json(tmp_dir / "trainer.json", trainer)


def save_shared_files(tmp_dir: Path, model_sd: dict, optimizer_sd: dict, scheduler_sd: dict, trainer: dict) -> None:
    """The replicated part of a data-parallel run (rank 0 only)."""
    save_model_shard(tmp_dir, "", model_sd, optimizer_sd)
    save_trainer_files(tmp_dir, scheduler_sd, trainer)


def tmp_dir_for(run_dir: Path, step: int) -> Path:
    final = step_dir(run_dir, step)
    return final.with_name(f".{final.name}.tmp")


def finalize(tmp_dir: Path, final_dir: Path, world_size: int, shards: tuple[str, ...] = ("",)) -> None:
    """Rank 0, after every rank wrote its files: manifest, then the atomic rename into place."""
    if final_dir.exists():
        raise CheckpointError(f"checkpoint {final_dir} already exists; refusing to overwrite it")
    expected = {"scheduler.pt", "trainer.json"}
    expected |= {f"model{shard}.pt" for shard in shards} | {f"optimizer{shard}.pt" for shard in shards}
    expected |= {f"rank{r}.pt" for r in range(world_size)} | {f"edgc_rank{r}.pt" for r in range(world_size)}
    present = {p.name for p in tmp_dir.iterdir() if not p.name.startswith(".")}
    if present != expected:
        raise CheckpointError(f"checkpoint {final_dir.name}: files missing after save: {sorted(expected - present)}")
    manifest = {
        "files": {
            name: {"sha256": sha256_file(tmp_dir / name), "bytes": (tmp_dir / name).stat().st_size}
            for name in sorted(expected)
        }
    }
    atomic_write_json(tmp_dir / "manifest.json", manifest)
    os.replace(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)


# ---------------------------------------------------------------------- verified load
def verify(ckpt_dir: Path, world_size: int | None = None) -> dict:
    """Check ``ckpt_dir`` against its manifest; return ``trainer.json``. Raises CheckpointError naming the bad file."""
    ckpt_dir = Path(ckpt_dir)
    manifest_path = ckpt_dir / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path} is missing: incomplete checkpoint") from None
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{manifest_path} is corrupt") from None
    for name, info in sorted(files.items()):
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        if path.stat().st_size != info.get("bytes") or sha256_file(path) != info.get("sha256"):
            raise CheckpointError(f"{path} is corrupt (sha256 does not match manifest.json)")
    try:
        trainer = json.loads((ckpt_dir / "trainer.json").read_text())
    except (FileNotFoundError, ValueError):
        raise CheckpointError(f"{ckpt_dir / 'trainer.json'} is missing or unreadable") from None
    ws = trainer.get("world_size") if world_size is None else world_size
    for r in range(ws or 0):
        for name in (f"rank{r}.pt", f"edgc_rank{r}.pt"):
            if name not in files:
                raise CheckpointError(
                    f"{ckpt_dir / name} is missing (checkpoint of a {trainer.get('world_size')}-process run)"
                )
    return trainer


def load(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load`` of a file already checked by ``verify``.

    ``weights_only=False`` because RNG states hold numpy/python objects; the sha256 check against the
    manifest written by this code is what makes that acceptable.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a corrupt file to the user
        raise CheckpointError(f"{path} cannot be loaded: {type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------------------- a rank's model and optimizer state
def local_tensors(obj):
    """``obj`` with every DTensor replaced by this rank's local tensor (plain tensors in the file, no mesh)."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, dict):
        return {k: local_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_tensors(v) for v in obj)
    return obj


def _as_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    return DTensor.from_local(
        local.to(like.device),
        like.device_mesh,
        like.placements,
        shape=like.shape,
        stride=like.stride(),
        run_check=False,
    )


def model_and_optimizer_state(module: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """What this rank writes: its model and optimizer state, DTensors (FSDP2 shards, tensor-parallel
    shards) as their local tensors."""
    return local_tensors(module.state_dict()), local_tensors(optimizer.state_dict())


def load_model_and_optimizer_state(module: torch.nn.Module, optimizer, model_sd: dict, optimizer_sd: dict) -> None:
    """The inverse of `model_and_optimizer_state`: local tensors copied into the parameters (their
    DTensors' local shards), the optimizer's state wrapped back into its parameters' DTensors."""
    with torch.no_grad():
        for name, param in module.state_dict().items():
            (param.to_local() if isinstance(param, DTensor) else param).copy_(model_sd[name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entries in optimizer_sd["state"].items():
        param = params[index]
        state[index] = {
            key: _as_dtensor(value, param)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and isinstance(param, DTensor)
            else value
            for key, value in entries.items()
        }
    optimizer.load_state_dict({**optimizer_sd, "state": state})
