"""Every `edgc experiment` on its tiny setting: the files exist and the numbers are sane."""

from __future__ import annotations

import json
import math

import pytest

from edgc_cli.main import main


def run(name: str, root, *extra: str) -> dict:
    code = main(["experiment", name, "--tiny", "--out", str(root), *extra])
    assert code == 0
    out = root / name
    summary = (out / "summary.md").read_text()
    assert "**Headline:**" in summary and "Command:" in summary
    pngs = sorted(out.rglob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)
    return json.loads((out / "results.json").read_text())


def cc_ok(value) -> bool:
    return value is None or math.isnan(value) or -1.0 - 1e-9 <= value <= 1.0 + 1e-9


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("experiments")


def test_entropy_trend(root):
    results = run("entropy-trend", root)["results"]
    assert set(results) == {"attention", "mlp", "embedding", "all"}
    for r in results.values():
        assert 0 < r["entropy_early"] < math.log(1000) + 1e-6
        assert cc_ok(r["cc_sampled_vs_full_windowed"])
        assert math.isfinite(r["kurt_late"])


def test_sampling(root):
    results = run("sampling", root, "--steps", "20")["results"]
    assert len(results) == 16
    assert results["1,1"]["time_ratio"] == pytest.approx(1.0)
    for r in results.values():
        assert r["time_ratio"] > 0 and cc_ok(r["cc"])
    assert results["0.1,0.25"]["time_ratio"] < 1  # sampling is cheaper than estimating on everything


def test_window(root):
    results = run("window", root, "--windows", "4,8")["results"]
    assert set(results) == {"4", "8"}
    for r in results.values():
        assert cc_ok(r["cc"])
        for mapping in ("delta", "cqm"):
            ranks = [x for x in r[mapping]["ranks"] if x]
            assert ranks and all(8 <= x <= 32 for x in ranks)


def test_cqm(root):
    data = run("cqm", root, "--captures", "2")
    assert data["rows"]
    for row in data["rows"]:
        assert row["model"] > 0 and 0 <= row["exact"] <= row["norm_sq"] * (1 + 1e-9)
        assert row["exact"] <= row["power_iteration"] * (1 + 1e-6) + 1e-12  # SVD is the optimum


def test_rank_sweep(root):
    data = run("rank-sweep", root, "--ranks", "4", "--steps", "4")
    none, r4 = data["results"]
    assert none["rank"] is None and r4["rank"] == 4
    assert 0 < r4["bytes_ratio"] < 1
    assert all(math.isfinite(r["val_loss"]) for r in data["results"])


def test_pure_dp(root):
    results = run("pure-dp", root, "--steps", "4")["results"]
    assert set(results) == {"none", "powersgd16", "edgc"}
    assert results["edgc"]["bytes_ratio_run"] < 1  # it compressed after the 2-step warm-up
    assert all(math.isfinite(r["val_loss"]) for r in results.values())


def test_refuses_existing_folder(root, capsys):
    (root / "cqm-existing" / "cqm").mkdir(parents=True)
    assert main(["experiment", "cqm", "--tiny", "--out", str(root / "cqm-existing")]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["rank-sweep", "--ranks", "4,x"], "--ranks"),
        (["window", "--windows", "0"], "--windows"),
        (["window", "--alpha", "2"], "--alpha"),
        (["cqm", "--captures", "0"], "--captures"),
        (["sampling", "--window", "0"], "--window"),
        (["pure-dp", "--link-mbit", "-1"], "--link-mbit"),
        (["entropy-trend", "--steps", "0"], "--steps"),
    ],
)
def test_bad_flags_fail_before_writing(tmp_path, capsys, argv, message):
    assert main(["experiment", *argv, "--tiny", "--out", str(tmp_path / "root")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "root").exists()
