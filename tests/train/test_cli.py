"""`edgc train` user errors: one line, exit 2, before any work, nothing overwritten.

And in-process single-process runs (a process group of one, no torchrun) of the compressors the
2-process test does not cover, each stopped and resumed to check the exact resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec

import pytest

from edgc_cli.main import main
from edgc_train.data import DataError, _pre_tokens_reach, check_split_sizes, load_corpus, prepare_data, split_corpus

from .conftest import FAST, SMALL_MODEL, cut_back, train_losses


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
    code = main(
        [
            "train",
            "--out",
            str(run),
            "--steps",
            "4",
            "--ckpt-every",
            "2",
            "--compressor",
            "none",
            "--cache-dir",
            str(cache_dir),
            *fast,
        ]
    )
    assert code == 0
    assert list((run / "tb").glob("events.out.tfevents.*"))  # TensorBoard is installed here
    return run


def test_ckpt_every_minus_one_writes_no_checkpoint(tmp_path, cache_dir):
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--out",
                str(run),
                "--steps",
                "2",
                "--ckpt-every",
                "-1",
                "--compressor",
                "none",
                "--cache-dir",
                str(cache_dir),
                *FAST,
            ]
        )
        == 0
    )
    assert (run / "metrics.jsonl").is_file() and not list(run.glob("checkpoints/*"))


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--compressor", "zip"],
            "compressor: must be one of none, allreduce, allreduce-blocking, nosync, powersgd, torch-powersgd, edgc",
        ),
        (["--steps", "ten"], "--steps: expected an integer, got 'ten'"),
        (["--steps", "0"], "steps: must be an integer ≥ 1"),
        (["--lr", "-3"], "lr: must be a number in (0, 10]"),
        (["--micro-batch", "1.5"], "--micro-batch: expected an integer"),
        (["--edgc", "window=0"], "EDGCConfig.window must be an integer ≥ 1"),
        (["--edgc", "windw=5"], "unknown field(s) ['windw']"),
        (["--edgc", "seed=3"], "--edgc seed: it is an engine field, --edgc engine.seed=3"),
        (["--edgc", "engine.sed=3"], "unknown field(s) ['engine.sed']"),
        (["--nproc", "0"], "--nproc: must be ≥ 1"),
        (["--data", "/no/such/corpus"], "does not exist"),
        (["--config", "/no/such/config.toml"], "config file /no/such/config.toml does not exist"),
        (["--compressor", "powersgd", "--edgc", "r_max=4"], "cannot be set for compressor powersgd"),
    ],
)
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


@pytest.mark.parametrize("module", ["tokenizers", "bible"])
def test_a_missing_extra_is_one_line_naming_it(capsys, tmp_path, monkeypatch, module):
    """A core install (`pip install edgc`) lacks the harness's dependencies: the line names the extra."""
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it fails
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == module else find_spec(name, *a))
    (tmp_path / "corpus.txt").write_text("In the beginning was the word, and the word was with God.\n" * 200)
    data = ["--data", str(tmp_path / "corpus.txt")] if module == "tokenizers" else []  # bible: the default corpus
    code, lines = edgc_train(capsys, "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache"), *data)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("edgc train: error:") and "pip install 'edgc[train]'" in lines[0], lines


def test_data_too_small_for_one_batch_is_one_line_before_any_worker_starts(capsys, tmp_path):
    (tmp_path / "t.txt").write_text("hello world\n")  # 9 + 3 bytes: no global batch of 2 x 8 blocks
    code, lines = edgc_train(
        capsys,
        "--out",
        str(tmp_path / "run"),
        "--nproc",
        "2",
        "--data",
        str(tmp_path / "t.txt"),
        "--cache-dir",
        str(tmp_path / "cache"),
    )
    assert code == 2 and len(lines) == 1, lines
    assert (
        "training split has 9 bytes of text, so at most as many tokens: too few for one global batch of "
        "16 x 129 tokens" in lines[0]
    )
    assert [p.name for p in tmp_path.iterdir()] == ["t.txt"]  # no run folder, no data cache


def test_the_data_check_counts_exactly_what_preparation_gives(tmp_path):
    """Between its bounds (fewer pre-tokens than needed, at least as many bytes) the check trains the
    tokenizer to count: the exact count passes and one token more fails, in either split."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"line {i}: the cat sat on mat number {i * 7919 % 1000}\n" for i in range(60)))
    args = (str(corpus), 300, 0.25, None)
    train_text, val_text = split_corpus(load_corpus([corpus]), 0.25)
    prepared = prepare_data(*args, cache_root=tmp_path / "prepared", log=lambda *a: None)
    counts = {"training": prepared.meta["train_tokens"], "validation": prepared.meta["val_tokens"]}
    for part, text in (("training", train_text), ("validation", val_text)):
        assert not _pre_tokens_reach(text, counts[part]) and len(text.encode()) > counts[part]  # between
    for cache_root in (tmp_path / "counted", tmp_path / "prepared"):  # counted here, or read from the cache
        check_split_sizes(*args, cache_root, {part: (n, part) for part, n in counts.items()}, "hint")
        for short in counts:
            needs = {part: (n + (part == short), part) for part, n in counts.items()}
            with pytest.raises(DataError, match=f"{short} split has {counts[short]} tokens: too few for {short}; hint"):
                check_split_sizes(*args, cache_root, needs, "hint")
    assert not (tmp_path / "counted").exists()


def test_python_m_form_gives_the_same_one_line_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "edgc_cli.main", "train", "--out", str(tmp_path / "run"), "--steps", "0"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "edgc train: error: steps: must be an integer ≥ 1, got 0"
    ]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _user_error_cases(root, small_run) -> dict[str, tuple[list[str], str]]:
    """Each user error of `edgc train` in a folder under ``root``: name -> (arguments, part of its line)."""
    (root / "empty.txt").write_text("\n  \n")
    (root / "binary.dat").write_bytes(bytes(range(256)) * 8)
    (root / "small.txt").write_text("hello world\n")
    (root / "existing").mkdir()
    (root / "existing" / "notes.txt").write_text("keep me")
    shutil.copytree(small_run, root / "corrupt")
    model = next((root / "corrupt" / "checkpoints").glob("step_*")) / "model.pt"
    data = bytearray(model.read_bytes())
    data[100] ^= 0x01
    model.write_bytes(bytes(data))
    data_flags = ["--out", "run", "--cache-dir", "cache", "--data"]
    return {
        "bad option": (["--out", "run", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        "bad value": (["--out", "run", "--steps", "0"], "steps: must be an integer ≥ 1"),
        "missing data": ([*data_flags, "missing.txt"], "does not exist"),
        "empty data": ([*data_flags, "empty.txt"], "holds no text"),
        "binary data": ([*data_flags, "binary.dat"], "binary.dat is a binary file"),
        "too-small data": ([*data_flags, "small.txt"], "too few for one global batch"),
        "existing --out": (["--out", "existing"], "existing already exists"),
        "corrupt checkpoint": (["--resume", "corrupt"], "model.pt is corrupt"),
    }


def _launch_all(form: list[str], cases: dict, cwd, log_root=None) -> dict[str, tuple[subprocess.Popen, object]]:
    """Start every case at once (each mostly waits for imports and rendezvous); wait for all."""
    running = {}
    for name, (args, _) in cases.items():
        logs = log_root / name.replace(" ", "_") if log_root is not None else None
        cmd = [*form[:-2], "--log-dir", str(logs), *form[-2:]] if logs else form
        running[name] = (
            subprocess.Popen(
                [*cmd, "train", *args], cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            ),
            logs,
        )
    return {name: (proc, *proc.communicate(timeout=300), logs) for name, (proc, logs) in running.items()}


def _assert_one_line(stderr: str, message: str, where: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgc train: error:") and message in lines[0], (where, stderr)
    assert "Traceback" not in stderr, where


# Under torchrun every check runs in the workers; these four take its four routes to the one line:
# argparse, a config value, the data check, the checkpoint check (each ~3 s of torchrun start-up).
TORCHRUN_CASES = ("bad option", "bad value", "too-small data", "corrupt checkpoint")


def test_every_user_error_is_one_line_exit_2_and_changes_nothing_in_every_launch_form(tmp_path, small_run):
    """The console script and every worker of `torchrun -m edgc_cli.main` (`python -m edgc_cli.main`
    runs the same ``main`` as the console script: test_python_m_form_gives_the_same_one_line_error).

    torchrun itself then reports its failed workers (its own traceback, exit 1), which no worker can
    change; so under torchrun the workers' logs are checked: rank 0 exits 2 and prints the one line,
    rank 1 prints nothing (it waits for rank 0 and is stopped by torchrun, -15). `edgc train
    --nproc N` checks everything before it starts torchrun: one line, exit 2.
    """
    work = tmp_path / "work"
    work.mkdir()
    cases = _user_error_cases(work, small_run)
    before = _tree_digest(work)
    console_script = [os.path.join(os.path.dirname(sys.executable), "edgc")]
    for name, (proc, _, stderr, _) in _launch_all(console_script, cases, work).items():
        assert proc.returncode == 2, (name, stderr)
        _assert_one_line(stderr, cases[name][1], ("console script", name))
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--redirects",
        "3",
        "-m",
        "edgc_cli.main",
    ]
    subset = {name: cases[name] for name in TORCHRUN_CASES}
    for name, (proc, _, agent_stderr, logs) in _launch_all(torchrun, subset, work, tmp_path / "logs").items():
        exits = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", agent_stderr))
        assert proc.returncode != 0 and exits.get("0") == "2" and exits.get("1") in ("2", "-15"), (name, agent_stderr)
        rank0, rank1 = (next(logs.glob(f"*/attempt_0/{rank}/stderr.log")).read_text() for rank in (0, 1))
        _assert_one_line(rank0, cases[name][1], ("torchrun rank 0", name))
        assert rank1 == "", (name, rank1)
    assert _tree_digest(work) == before


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
    cut_back(small_run, run, 4)  # latest is now step 2: resumable
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
    job = [
        "--steps",
        "8",
        "--ckpt-every",
        "4",
        "--eval-every",
        "0",
        "--compressor",
        compressor,
        "--powersgd-rank",
        "4",
        "--cache-dir",
        str(cache_dir),
        *FAST,
        *SMALL_MODEL,
    ]
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
    # one process with a process group: collectives are issued as in any world, as DDP does
    # (3 per compressed bucket: raw, P, Q); native DDP's own are not counted
    collectives = lines[-2]["collectives"]
    assert collectives == 0 if compressor == "none" else (collectives >= 3 and collectives % 3 == 0), collectives


def test_budget_run_tells_each_decision_and_resumes_exactly(capsys, tmp_path, cache_dir):
    """With a byte budget the rank moves; every decision is a line of its own and a metrics record,
    the summary states the budget and the mean rank spent, and a resume across the moves is exact."""
    job = [
        "--steps",
        "24",
        "--ckpt-every",
        "12",
        "--eval-every",
        "0",
        "--compressor",
        "edgc",
        "--edgc",
        "r_max=8",
        "--edgc",
        "rank_budget=4",
        "--edgc",
        "window=4",
        "--cache-dir",
        str(cache_dir),
        *FAST,
        *SMALL_MODEL,
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", "--out", str(a), *job]) == 0
    out = capsys.readouterr().out
    records = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    decisions = [r for r in records if r["kind"] == "decision"]
    assert decisions and any(d["rank"] != d["old_rank"] for d in decisions)
    for d in decisions:  # printed whole, on a line of its own
        assert d["message"] in out.splitlines()
    ranks = [r["rank"] for r in records if r["kind"] == "train" and r["phase"] == "compress"]
    [warmup] = [r for r in records if r["kind"] == "warmup_over"]  # the library's records, every kind
    first = min(r["step"] for r in records if r["kind"] == "train" and r["phase"] == "compress")
    assert warmup["message"] in out.splitlines() and warmup["step"] == first - 1  # a train line counts steps done
    summary = json.loads((a / "summary.json").read_text())
    assert summary["rank_budget"] == 4 and summary["mean_rank"] == pytest.approx(sum(ranks) / len(ranks))
    assert summary["rank_changes"] == len(set(ranks)) - 1 == sum(d["rank"] != d["old_rank"] for d in decisions)
    assert main(["train", "--out", str(b), "--stop-at", "12", *job]) == 0
    assert main(["train", "--resume", str(b)]) == 0
    assert train_losses(a) == train_losses(b)
