"""Calibration plumbing on a synthetic run folder, host measurement helpers, and the CLI."""

import dataclasses
import json

import pytest

from edgc_cli.main import main
from edgc_sim.calibrate import calibrate, host_model, load_run
from edgc_sim.calibration_tables import format_calibration
from edgc_sim.hardware import DeviceSpec, LinkSpec
from edgc_sim.host import fit_alpha_beta, load_profile, measure_host, save_profile

DEVICE = DeviceSpec("host", {"fp32": 50e9}, 1.0, 10e9, 5e-6)
LINK = LinkSpec("host-gloo", 1.5e9, 1.0, 100e-6)
CONFIG = {
    "preset": "tiny",
    "world_size": 2,
    "micro_batch": 8,
    "seq_len": 128,
    "grad_accum": 1,
    "compressor": "edgc",
    "n_layer": None,
    "vocab_size": 4096,
    "model": {"n_layer": 4, "n_embd": 256, "n_head": 4, "n_positions": 256, "vocab_size": 512},
}


def write_run(tmp_path, slow=1.1):
    """A run whose steps are `slow` x the model's prediction: 20 uncompressed, 30 at rank 8."""
    run = tmp_path / "run1"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(CONFIG))
    model = host_model(CONFIG, DEVICE, LINK)
    lines = [json.dumps({"kind": "eval", "step": 0})]
    for step in range(1, 51):
        rank = None if step <= 20 else 8
        it = model.iteration((rank,))
        lines.append(
            json.dumps(
                {
                    "kind": "train",
                    "step": step,
                    "rank": rank,
                    "phase": "x",
                    "step_time_s": slow * it.iteration_s,
                    "comm_time_s": slow * it.sync[0].comm_s,
                    "compute_time_s": 0.0,
                    "bytes_sent": 0,
                    "bytes_raw": 0,
                }
            )
        )
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_calibrate_reports_error_per_rank(tmp_path):
    rows = calibrate([load_run(write_run(tmp_path))], DEVICE, LINK)
    assert [(r.rank, r.steps) for r in rows] == [(None, 15), (8, 30)]  # first 10% of steps skipped
    for r in rows:
        assert r.step_error == pytest.approx(1 / 1.1 - 1)
        assert r.comm_error == pytest.approx(1 / 1.1 - 1)
    table = format_calibration(rows)
    assert "-9.1%" in table and table.count("\n") == 3


def test_host_model_reads_resolved_shape():
    model = host_model(CONFIG, DEVICE, LINK)
    st = model.stages[0]
    # HF GPT-2: tied 512 x 256 embedding (no padding), 256 positions, 4 blocks
    assert (512, 256) in st.matrices and (256, 256) in st.matrices
    assert st.values == 4 * (12 * 256**2 + 13 * 256) + (512 + 256) * 256 + 2 * 256


def test_load_run_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="missing config.json"):
        load_run(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="missing keys"):
        load_run(tmp_path)


def test_fit_alpha_beta_recovers_parameters():
    alpha, beta = 50e-6, 2e9
    sizes = [4e3, 1e5, 1e6, 1e7]
    times = [2 * alpha + n / beta for n in sizes]
    a, b = fit_alpha_beta(2, sizes, times)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_measure_host_and_profile_roundtrip(tmp_path):
    dev = measure_host(threads=1, matmul_n=128, copy_mb=4)
    assert dev.matmul_flops["fp32"] > 1e8 and dev.mem_bytes_per_s > 1e8 and dev.launch_s > 0
    assert dev.alloc_bytes_per_s >= 0 and dev.alloc_s(1e6) >= 0
    save_profile(tmp_path / "p.json", dev, LINK)
    assert load_profile(tmp_path / "p.json") == (dev, LINK)
    # a profile saved when the engine ran torch.linalg.qr: its QR rate is not the engine's any more
    old = json.loads((tmp_path / "p.json").read_text())
    old["device"]["qr_flops_per_s"] = old["device"].pop("orth_flops_per_s")
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert load_profile(tmp_path / "old.json") == (dataclasses.replace(dev, orth_flops_per_s=0.0), LINK)
    # two processes at once, as a bench's two ranks share the CPU
    both = measure_host(threads=1, matmul_n=128, copy_mb=4, processes=2)
    assert both.mem_bytes_per_s > 1e8 and "2 processes at once" in both.source


def test_cli_simulate_preset_measures_nothing(tmp_path, capsys, monkeypatch):
    """A preset is the whole machine: projecting onto it measures neither this host nor its link."""
    import edgc_sim.host

    def refuse(*args, **kwargs):
        raise AssertionError("a preset run measured the host")

    for name in ("measure_host", "measure_cuda", "measure_link"):
        monkeypatch.setattr(edgc_sim.host, name, refuse)
    assert main(["simulate", "--preset", "gpt2-12.1b", "--out-dir", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out
    assert "EDGC" in out and "time reduction" in out
    assert (tmp_path / "simulate_gpt2-12.1b.png").stat().st_size > 1000
    data = json.loads((tmp_path / "simulate_gpt2-12.1b.json").read_text())
    assert set(data["methods"]) == {"none", "powersgd", "optimus-cc", "edgc"}


def test_cli_calibrate_with_profile(tmp_path, capsys):
    run = write_run(tmp_path)
    save_profile(tmp_path / "p.json", DEVICE, LINK)
    assert main(["simulate", "--calibrate", str(run), "--host-profile", str(tmp_path / "p.json")]) == 0
    assert "-9.1%" in capsys.readouterr().out


def test_cli_user_errors(tmp_path, capsys):
    assert main(["simulate", "--preset", "gpt2-345m", "--iterations", "0", "--no-plot"]) == 2
    assert "iterations" in capsys.readouterr().err
    assert main(["simulate", "--metrics", str(tmp_path / "nope.jsonl"), "--no-plot"]) == 2
