"""Bench-mode calibration (`edgc simulate --calibrate <bench>/runs/*`) on a synthetic bench folder."""
import json

import pytest

from edgc_cli.main import main
from edgc_sim.calibrate import (bench_link, calibrate_bench, compress_model, find_bench_calibration,
                                format_bench_calibration, load_run, nominal_link, wire_time)
from edgc_sim.hardware import DeviceSpec

DEVICE = DeviceSpec("host", {"fp32": 50e9}, 1.0, 10e9, 5e-6)
MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64, "vocab_size": 256}
MBIT = 1000.0
BETA = 0.92 * MBIT * 1e6 / 8  # what tbf delivers
COMPUTE, WAIT = 0.5, 0.05


def config(compressor):
    return {"preset": "tiny", "world_size": 2, "micro_batch": 2, "seq_len": 32, "grad_accum": 1,
            "compressor": compressor, "powersgd_rank": 4, "model": MODEL}


def write_bench(tmp_path):
    """calibration.json measured at BETA, and runs whose times follow the bench model exactly."""
    bench = tmp_path / "bench"
    (bench / "runs").mkdir(parents=True)
    (bench / "calibration.json").write_text(json.dumps(
        [{"mb": mb, "seconds": mb * 2 ** 20 / BETA} for mb in (1.0, 4.0, 16.0)]))
    link = nominal_link(MBIT * 0.92)
    payload = {"none": (None, 400_000.0), "fp16": (None, 200_000.0), "powersgd": (4, 20_000.0)}
    for name, (rank, nbytes) in payload.items():
        run = bench / "runs" / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps(config(name)))
        compress = compress_model(name, rank, config(name), DEVICE)
        comm = wire_time(name, 2, nbytes, link) + WAIT
        lines = []
        for step in range(1, 21):
            warm = rank is not None and step <= 4  # uncompressed warm-up: a different workload, ignored
            lines.append(json.dumps({
                "kind": "train", "step": step, "rank": None if warm else rank,
                "bytes_sent": 400_000 if warm else nbytes, "compute_time_s": COMPUTE,
                "compress_time_s": compress, "comm_time_s": 9.0 if warm else comm,
                "step_time_s": 9.0 if warm else COMPUTE + compress + comm}))
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return bench


def test_bench_link_fits_calibration(tmp_path):
    bench = write_bench(tmp_path)
    link = bench_link(bench / "calibration.json")
    assert link.bytes_per_s == pytest.approx(BETA, rel=1e-6) and link.latency_s == pytest.approx(0, abs=1e-9)
    assert find_bench_calibration(sorted((bench / "runs").iterdir())) == (bench / "calibration.json").resolve()
    assert find_bench_calibration([tmp_path]) is None


def test_calibrate_bench_matches_its_own_model(tmp_path):
    bench = write_bench(tmp_path)
    runs = [load_run(d) for d in sorted((bench / "runs").iterdir())]
    rows = calibrate_bench(runs, DEVICE, bench_link(bench / "calibration.json"))
    assert [(r.run, r.rank, r.steps) for r in rows] == [("fp16", None, 18), ("none", None, 18), ("powersgd", 4, 16)]
    for r in rows:  # warm-up steps (rank None in a compressed run) and the first 10% are left out
        assert r.comm_error == pytest.approx(0, abs=1e-9) and r.step_error == pytest.approx(0, abs=1e-9)
        assert r.wire_predicted_s == pytest.approx(r.comm_measured_s - WAIT)
    assert rows[2].bytes_sent == 20_000 and rows[2].compress_modelled
    table = format_bench_calibration(rows, nominal_link(MBIT), DEVICE)
    assert "+0.0% (ref)" in table and table.count("| powersgd | 4 |") == 1
    with pytest.raises(ValueError, match="uncompressed run"):
        calibrate_bench(runs[2:], DEVICE, nominal_link(MBIT))


def test_cli_calibrate_bench(tmp_path, capsys):
    bench = write_bench(tmp_path)
    profile = tmp_path / "host.json"
    profile.write_text(json.dumps({"device": DEVICE.__dict__, "link": None}))
    dirs = [str(d) for d in sorted((bench / "runs").iterdir())]
    assert main(["simulate", "--calibrate", *dirs, "--host-profile", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "fit of" in out and "| none | - | 18 |" in out
    assert main(["simulate", "--calibrate", *dirs, "--host-profile", str(profile), "--link-mbit", "920"]) == 0
    assert "nominal 920 Mbit/s" in capsys.readouterr().out
