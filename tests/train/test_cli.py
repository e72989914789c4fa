"""`edgc train` user errors: one line, exit 2, before any work, nothing overwritten.

And in-process single-process runs (a process group of one, no torchrun) of the compressors the
2-process test does not cover, each stopped and resumed to check the exact resume.
"""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from edgc_cli.main import main

from .conftest import FAST, train_losses


def _tree_digest(path):
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def edgc_train(capsys, *args):
    """Run `edgc train ARGS` in this process; return (exit code, stderr lines)."""
    code = main(["train", *args])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, cache_dir):
    """A finished 1-process run to resume from (and to try to damage)."""
    run = tmp_path_factory.mktemp("small") / "run"
    fast = [a for a in FAST if a != "--no-tensorboard"]
    code = main(["train", "--out", str(run), "--steps", "4", "--ckpt-every", "2", "--compressor", "none",
                 "--cache-dir", str(cache_dir), *fast])
    assert code == 0
    assert list((run / "tb").glob("events.out.tfevents.*"))  # TensorBoard is installed here
    return run


@pytest.mark.parametrize("args,message", [
    (["--compressor", "zip"], "compressor: must be one of none, allreduce, allreduce-blocking, nosync, powersgd, torch-powersgd, edgc"),
    (["--steps", "ten"], "--steps: expected an integer, got 'ten'"),
    (["--steps", "0"], "steps: must be an integer ≥ 1"),
    (["--lr", "-3"], "lr: must be a number in (0, 10]"),
    (["--micro-batch", "1.5"], "--micro-batch: expected an integer"),
    (["--edgc", "window=0"], "EDGCConfig.window must be an integer ≥ 1"),
    (["--edgc", "windw=5"], "unknown field(s) ['windw']"),
    (["--nproc", "0"], "--nproc: must be ≥ 1"),
    (["--data", "/no/such/corpus"], "does not exist"),
    (["--config", "/no/such/config.toml"], "config file /no/such/config.toml does not exist"),
    (["--compressor", "powersgd", "--edgc", "r_max=4"], "cannot be set for compressor powersgd"),
])
def test_bad_input_is_one_line_and_creates_nothing(capsys, tmp_path, args, message):
    out = tmp_path / "run"
    code, lines = edgc_train(capsys, "--out", str(out), *args)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert lines[0].startswith("edgc train: error:")
    assert not out.exists()


def test_help_lists_every_config_field(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--micro-batch", "--grad-accum", "--compressor", "--edgc", "--resume", "--nproc", "--stop-at"):
        assert flag in text


def test_empty_data_is_rejected(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("\n \n")
    (tmp_path / "folder").mkdir()
    for data, message in ((tmp_path / "empty.txt", "holds no text"), (tmp_path / "folder", "no text files")):
        code, lines = edgc_train(capsys, "--out", str(tmp_path / "run"), "--data", str(data))
        assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_existing_run_is_never_overwritten(capsys, small_run):
    before = _tree_digest(small_run)
    code, lines = edgc_train(capsys, "--out", str(small_run), "--steps", "4")
    assert code == 2 and "already exists" in lines[0] and len(lines) == 1
    code, lines = edgc_train(capsys, "--resume", str(small_run))
    assert code == 2 and "already finished" in lines[0]
    code, lines = edgc_train(capsys, "--resume", str(small_run), "--steps", "8")
    assert code == 2 and "cannot change" in lines[0] and "--steps" in lines[0]
    assert _tree_digest(small_run) == before


def test_corrupt_or_mismatched_checkpoint_is_refused(capsys, small_run, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(small_run, run)
    shutil.rmtree(run / "checkpoints" / "step_000004")  # latest is now step 2: resumable
    (run / "summary.json").unlink()
    target = run / "checkpoints" / "step_000002" / "optimizer.pt"
    data = bytearray(target.read_bytes())
    data[100] ^= 0x01
    target.write_bytes(bytes(data))
    before = _tree_digest(run)
    code, lines = edgc_train(capsys, "--resume", str(run))
    assert code == 2 and len(lines) == 1 and "step_000002/optimizer.pt is corrupt" in lines[0], lines
    assert _tree_digest(run) == before  # refused before touching anything
    target.write_bytes(bytes(data[:100]) + bytes([data[100] ^ 0x01]) + bytes(data[101:]))  # repaired
    code, lines = edgc_train(capsys, "--resume", str(run), "--nproc", "2")
    assert code == 2 and "written by 1 processes, this run has 2" in lines[0]
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "lr": 0.5}))
    code, lines = edgc_train(capsys, "--resume", str(run))
    assert code == 2 and "does not match config.json (lr)" in lines[0], lines
    (run / "config.json").write_text(json.dumps({**config, "edgc": {"window": 7}}))
    code, lines = edgc_train(capsys, "--resume", str(run))
    assert code == 2 and "EDGC config derived now differs from config.json (window)" in lines[0], lines
    (run / "config.json").write_text(json.dumps(config))
    code, lines = edgc_train(capsys, "--resume", str(run), "--stop-at", "1")
    assert code == 2 and "--stop-at 1 is not after the checkpoint's step 2" in lines[0], lines
    code, lines = edgc_train(capsys, "--resume", str(tmp_path / "nothing"))
    assert code == 2 and "not a run folder" in lines[0]


@pytest.mark.parametrize("compressor", ["torch-powersgd", "powersgd", "none"])
def test_single_process_resume_is_exact(capsys, tmp_path, cache_dir, compressor):
    job = ["--steps", "8", "--ckpt-every", "4", "--eval-every", "0", "--compressor", compressor,
           "--powersgd-rank", "4", "--cache-dir", str(cache_dir), *FAST]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", "--out", str(a), *job]) == 0
    assert main(["train", "--out", str(b), "--stop-at", "4", *job]) == 0
    assert max(train_losses(b)) == 4
    assert main(["train", "--resume", str(b)]) == 0
    la, lb = train_losses(a), train_losses(b)
    assert [lb[s] for s in range(5, 9)] == [la[s] for s in range(5, 9)]
    lines = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    if compressor != "none":  # warm-up floor ⌊0.1·8⌋ → 2 uncompressed steps, then rank 4
        assert [r["rank"] for r in lines if r["kind"] == "train"][-1] == 4
        assert lines[-2]["elements_sent"] < lines[-2]["elements_raw"]
    # one process: our engine issues no collectives; torch's hook does (one bucket: raw, P, Q)
    assert lines[-2]["collectives"] == (3 if compressor == "torch-powersgd" else 0)
