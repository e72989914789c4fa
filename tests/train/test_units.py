"""Unit tests of the harness pieces: config validation, data pipeline, sampler, checkpoints, model."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from edgc_train import checkpoint as ckpt
from edgc_train.cli import load_config_file, parse_edgc_flags
from edgc_train.config import TrainConfig, field_help, merge_edgc, scaled_edgc_defaults
from edgc_train.data import DataError, prepare_data, source_files, split_text
from edgc_train.model import build_model, count_parameters, model_shape
from edgc_train.sampler import BlockSampler, val_batches


# ------------------------------------------------------------------ config
def test_every_field_has_a_one_line_doc():
    docs = field_help()
    for name in TrainConfig.__dataclass_fields__:
        assert docs.get(name) and "\n" not in docs[name], name


@pytest.mark.parametrize(
    "field,value",
    [
        ("compressor", "zip"),
        ("steps", 0),
        ("steps", 2.5),
        ("micro_batch", -1),
        ("lr", 0.0),
        ("lr", float("nan")),
        ("vocab_size", 100),
        ("val_fraction", 0.9),
        ("warmup_steps", 500),
        ("preset", "huge"),
        ("seq_len", 1),
        ("grad_clip", -1.0),
        ("dropout", 1.0),
        ("tensorboard", "yes"),
        ("n_head", 3),
        ("edgc", {"window": 0}),
        ("edgc", {"no_such_field": 1}),
        ("interstage", "sometimes"),
        ("interstage_rank", 0),
        ("tp", 0),
        ("tp", 3),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError) as err:
        TrainConfig(**{field: value})
    # The message names the offending field (EDGC fields are named inside the EDGC message).
    names = [field] + (list(value) if isinstance(value, dict) else [])
    assert any(n in str(err.value) for n in names), str(err.value)


def test_edgc_fields_rejected_for_other_compressors():
    with pytest.raises(ValueError, match="edgc"):
        TrainConfig(compressor="none", edgc={"r_max": 8})
    with pytest.raises(ValueError, match="r_max cannot be set for compressor powersgd"):
        TrainConfig(compressor="powersgd", edgc={"r_max": 8})
    assert TrainConfig(compressor="powersgd", edgc={"window": 9}).edgc_config.window == 9


def test_config_file_json_and_toml(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"steps": 7, "edgc": {"r_max": 4}}))
    (tmp_path / "c.toml").write_text('steps = 9\ncompressor = "powersgd"\n')
    assert TrainConfig.from_dict(load_config_file(tmp_path / "c.json")).edgc_config.r_max == 4
    cfg = TrainConfig.from_dict(load_config_file(tmp_path / "c.toml"))
    assert cfg.steps == 9 and cfg.edgc_config.adaptive is False and cfg.edgc_config.r_max == 8
    (tmp_path / "bad.json").write_text("{steps: 1")
    with pytest.raises(ValueError, match="not valid"):
        load_config_file(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="unknown config field"):
        TrainConfig.from_dict({"stepz": 3})


@pytest.mark.parametrize("steps", [1, 20, 50, 200, 1000, 5000, 100_000])
def test_edgc_knobs_scale_with_run_length(steps):
    d = scaled_edgc_defaults(steps)
    sample_every = round(1 / d["iteration_sample_ratio"])
    assert 10 <= d["window"] <= 1000
    assert d["window"] // sample_every >= 5  # a window holds at least 5 entropy samples
    assert 2 <= d["profile_max_rank"] <= 128
    if steps >= 40:  # step 0, the quick test, 2 steps per candidate rank: inside the 10 % warm-up floor
        assert 2 + 2 * (d["profile_max_rank"].bit_length() - 1) <= steps // 10
    cfg = TrainConfig(steps=steps).edgc_config
    assert cfg.total_steps == steps and cfg.window == d["window"]
    if steps >= 20_000:
        assert d["window"] == 1000 and sample_every == 10  # the paper's values


def test_the_engines_fields_are_its_table_in_files_and_flags():
    flags = parse_edgc_flags(["r_max=4", "engine.seed=3", "engine.error_feedback=false"])
    assert flags == {"r_max": 4, "engine": {"seed": 3, "error_feedback": False}}
    assert merge_edgc({"window": 9, "engine": {"seed": 1, "rank_change": "truncate"}}, flags) == {
        "window": 9,
        "r_max": 4,
        "engine": {"seed": 3, "rank_change": "truncate", "error_feedback": False},
    }
    assert TrainConfig(compressor="powersgd", edgc={"engine": {"seed": 3}}).edgc_config.engine.seed == 3
    with pytest.raises(ValueError, match="EDGCConfig has no field 'seed': it is an engine field"):
        TrainConfig(edgc={"seed": 3})  # a file's [edgc] table with the engine's field beside the others


def test_a_run_folder_written_with_the_engine_fields_flat_still_loads(tmp_path):
    from edgc_train.run_folder import config_from_run

    cfg = TrainConfig(steps=40, edgc={"r_max": 4, "engine": {"seed": 3}})
    flat = {"r_max": 4, "seed": 3}  # the overrides of a run begun before the engine's fields were nested
    (tmp_path / "config.json").write_text(json.dumps({**cfg.to_dict(), "edgc_overrides": flat}))
    assert config_from_run(tmp_path) == cfg and config_from_run(tmp_path).edgc_config.engine.seed == 3


def test_user_edgc_fields_win_over_scaled_defaults():
    cfg = TrainConfig(steps=200, edgc={"window": 33, "r_max": 12}).edgc_config
    assert cfg.window == 33 and cfg.r_max == 12


# ------------------------------------------------------------------ data
@pytest.fixture()
def corpus(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "the", "and", "of", "light", "water", "earth"]
    for i in range(3):
        lines = [" ".join(rng.choice(words, 12)) + "." for _ in range(400)]
        (folder / f"doc{i}.txt").write_text("\n".join(lines))
    (folder / "skip.bin").write_bytes(b"\x00\xff")  # not a text suffix: ignored
    return folder


def test_prepare_data_caches_and_reuses(corpus, tmp_path):
    cache = tmp_path / "cache"
    first = prepare_data(str(corpus), 300, 0.1, cache_root=cache, log=lambda *a: None)
    assert first.vocab_size <= 300 and first.train.dtype == np.uint16
    assert first.meta["train_tokens"] > 5 * first.meta["val_tokens"] > 0
    stamp = os.stat(first.dir / "train.npy").st_mtime_ns
    logs = []
    again = prepare_data(str(corpus), 300, 0.1, cache_root=cache, log=logs.append)
    assert again.dir == first.dir and not logs and os.stat(again.dir / "train.npy").st_mtime_ns == stamp
    assert np.array_equal(again.train, first.train)
    other = prepare_data(str(corpus), 280, 0.1, cache_root=cache, log=lambda *a: None)
    assert other.dir != first.dir  # vocab size is part of the key
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(first.tokenizer_path))
    assert tok.decode([int(i) for i in first.val[:50]]).strip()


def test_data_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        source_files(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text files"):
        source_files(str(tmp_path / "empty"))
    (tmp_path / "blank.txt").write_text("  \n\n")
    with pytest.raises(DataError, match="empty"):
        prepare_data(str(tmp_path / "blank.txt"), 300, 0.1, cache_root=tmp_path / "c", log=lambda *a: None)


def test_default_corpus_is_the_kjv():
    (path,) = source_files(None)
    assert path.name == "kjv.jsonl" and path.stat().st_size > 6_000_000


def test_split_is_deterministic_and_on_a_line_boundary():
    text = "\n".join(f"line {i}" for i in range(1000))
    train, val = split_text(text, 0.1)
    assert train + val == text and val.startswith("line ") and train.endswith("\n")
    assert split_text(text, 0.1) == (train, val)
    assert 0.08 < len(val) / len(text) < 0.12


def test_sampler_shards_ranks_and_resumes_exactly():
    tokens = np.arange(10_000, dtype=np.uint16)
    ranks = [BlockSampler(tokens, 16, 4, r, 2, seed=3) for r in range(2)]
    seen = [set(), set()]
    for _ in range(ranks[0].batches_per_epoch):
        for r, s in enumerate(ranks):
            x, y = s.next_batch()
            assert x.shape == y.shape == (4, 16) and np.array_equal(x[:, 1:], y[:, :-1])
            seen[r].update(int(v) for v in x[:, 0])
    assert not seen[0] & seen[1]  # no block is given to both ranks in an epoch
    # Save mid-way through the second epoch, continue in a fresh sampler: identical batches.
    s = BlockSampler(tokens, 16, 4, 1, 2, seed=3)
    for _ in range(s.batches_per_epoch + 5):
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))  # plain JSON-able numbers
    t = BlockSampler(tokens, 16, 4, 1, 2, seed=3)
    t.load_state_dict(state)
    for _ in range(s.batches_per_epoch):
        assert all(np.array_equal(a, b) for a, b in zip(s.next_batch(), t.next_batch()))
    with pytest.raises(ValueError, match="world_size"):
        BlockSampler(tokens, 16, 4, 0, 4, seed=3).load_state_dict(state)


def test_sampler_needs_one_batch():
    with pytest.raises(DataError, match="too few"):
        BlockSampler(np.arange(100, dtype=np.uint16), 64, 4, 0, 2, seed=0)


def test_val_batches_cover_fixed_disjoint_blocks():
    tokens = np.arange(5000, dtype=np.uint16)
    per_rank = [[x for x, _ in val_batches(tokens, 10, 3, 2, r, 2)] for r in range(2)]
    starts = [{int(v) for x in xs for v in x[:, 0]} for xs in per_rank]
    assert len(starts[0]) == len(starts[1]) == 6 and not starts[0] & starts[1]
    assert [x.tolist() for x, _ in val_batches(tokens, 10, 3, 2, 0, 2)] == [x.tolist() for x in per_rank[0]]


# ------------------------------------------------------------------ checkpoints
def _fake_checkpoint(run_dir, step=5, world=2):
    tmp = ckpt.tmp_dir_for(run_dir, step)
    tmp.mkdir(parents=True)
    for r in range(world):
        ckpt.save_rank_files(tmp, r, {"epoch": 0, "batch": r}, {"rank": r})
    ckpt.save_shared_files(tmp, {"w": torch.ones(3)}, {"o": 1}, {"s": 2}, {"step": step, "world_size": world})
    ckpt.finalize(tmp, ckpt.step_dir(run_dir, step), world)
    return ckpt.step_dir(run_dir, step)


def test_checkpoint_roundtrip_and_latest(tmp_path):
    d5 = _fake_checkpoint(tmp_path, 5)
    d12 = _fake_checkpoint(tmp_path, 12)
    (tmp_path / "checkpoints" / ".step_000099.tmp").mkdir()  # a crashed save is never "latest"
    assert ckpt.latest_checkpoint(tmp_path) == d12
    assert ckpt.verify(d5)["step"] == 5
    assert torch.equal(ckpt.load(d5 / "model.pt")["w"], torch.ones(3))
    state = ckpt.load(d5 / "rank1.pt")
    assert state["sampler"] == {"epoch": 0, "batch": 1} and set(state["rng"]) == {"torch", "cuda", "numpy", "python"}
    assert not list(d5.glob(".*"))  # no temp files left behind
    with pytest.raises(ckpt.CheckpointError, match="already exists"):
        _fake_checkpoint(tmp_path, 5)


def test_corrupt_or_incomplete_checkpoint_names_the_file(tmp_path):
    d = _fake_checkpoint(tmp_path)
    data = bytearray((d / "edgc_rank1.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / "edgc_rank1.pt").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="edgc_rank1.pt is corrupt"):
        ckpt.verify(d)
    (d / "edgc_rank1.pt").unlink()
    with pytest.raises(ckpt.CheckpointError, match="edgc_rank1.pt is missing"):
        ckpt.verify(d)
    (d / "manifest.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="manifest.json is missing"):
        ckpt.verify(d)


def test_rng_state_roundtrip():
    state = ckpt.rng_state()
    a = (torch.rand(3), np.random.rand(), __import__("random").random())
    ckpt.set_rng_state(state)
    b = (torch.rand(3), np.random.rand(), __import__("random").random())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


# ------------------------------------------------------------------ model
def test_presets_have_the_documented_sizes():
    torch.manual_seed(0)
    assert 3e6 < count_parameters(build_model(model_shape("tiny", 4096, 128))) < 5e6
    assert 25e6 < count_parameters(build_model(model_shape("small", 8192, 128))) < 35e6
    shape = model_shape("gpt2", 50257, 1024)
    # Counted from the shape (building 124M parameters is slow on 2 cores): GPT-2 small's 124.4M.
    d, L, V, P = shape["n_embd"], shape["n_layer"], shape["vocab_size"], shape["n_positions"]
    assert V * d + P * d + L * (12 * d * d + 13 * d) + 2 * d == 124_439_808


def test_model_overrides_and_checks():
    shape = model_shape("tiny", 512, 600, n_layer=1, n_embd=64, n_head=2)
    assert shape["n_positions"] == 600 and shape["n_layer"] == 1
    with pytest.raises(ValueError, match="n_head"):
        model_shape("tiny", 512, 64, n_embd=65)
    with pytest.raises(ValueError, match="n_positions"):
        model_shape("tiny", 512, 64, n_positions=32)


def test_resume_drops_metric_lines_after_the_checkpoint(tmp_path):
    from edgc_train.run_folder import MetricsLog

    lines = [{"kind": "train", "step": s} for s in range(1, 7)] + [{"kind": "eval", "step": 5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    log = MetricsLog(tmp_path, enabled=True, tensorboard=False, resume_step=4)
    log.write({"kind": "train", "step": 5})
    log.close()
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in kept] == [("train", s) for s in (1, 2, 3, 4, 5)]


@pytest.mark.parametrize(
    "plan, words",
    [
        ([{"train": []}, {"train": [], "nproc": 1}, {"train": [], "nproc": 2}], "step 2: nproc 2 must be in [1, 1]"),
        ([{"train": [], "nproc": 8}], "step 0: nproc 8 must be in [1, 4]"),
        ([{"train": [], "cut_back": []}], "step 0: needs exactly one of"),
        ([{"nproc": 2}], "step 0: needs exactly one of"),
    ],
)
def test_a_plan_whose_world_grows_or_whose_step_is_unclear_is_refused(plan, words):
    from edgc_train.plan import check_plan

    check_plan([{"train": []}, {"cut_back": [], "nproc": 2}, {"train": [], "nproc": 1}], 4)  # a shrinking plan
    with pytest.raises(ValueError) as error:
        check_plan(plan, 4)
    assert words in str(error.value)
