"""Calibrating the inter-stage model on a synthetic TP × PP bench folder (no training, no network)."""

import json
import re

import pytest

from edgc.parallel.interstage import wire_bytes
from edgc_cli.main import main
from edgc_sim.calibrate import load_run
from edgc_sim.calibrate_pipeline import calibrate_pipeline, format_pipeline_calibration, predict_schedule
from edgc_sim.cost_model import AlphaBeta
from edgc_sim.hardware import DeviceSpec, LinkSpec
from edgc_sim.host import save_profile

DEVICE = DeviceSpec("host", {"fp32": 20e9}, 1.0, 10e9, 2e-6)
LINK = LinkSpec("host-gloo", 1.2e9, 1.0, 150e-6, "test link")
TOKENS, HIDDEN, M = 2 * 32, 64, 4
CONFIG = {
    "preset": "tiny",
    "world_size": 8,
    "micro_batch": 2,
    "seq_len": 32,
    "grad_accum": M,
    "compressor": "none",
    "tp": 2,
    "pp": 2,
    "interstage": "cooldown",
    "interstage_rank": 4,
    "model": {"n_layer": 2, "n_embd": HIDDEN, "n_head": 4, "n_positions": 32, "vocab_size": 100},
}


def write_bench(tmp_path, slow=1.0, wrong_bytes=False):
    """A bench folder with one run whose steps follow the model's own schedule (inter-stage time x `slow`)."""
    run = tmp_path / "bench" / "runs" / "none"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(CONFIG))
    t_fwd, t_bwd = [0.01, 0.012], [0.02, 0.03]
    lines = []
    for step in range(1, 21):
        ranks = (None, None) if step <= 10 else (None, 4)  # EDGC-like: raw until the rank is known
        timeline, per_stage, wire, compress = predict_schedule(
            t_fwd, t_bwd, M, "cooldown", ranks, TOKENS, HIDDEN, AlphaBeta(LINK.latency_s, LINK.bytes_per_s), DEVICE
        )
        # bytes counted independently: 3 raw gradients (with header) and, from step 11, one at rank 4
        last = wire_bytes(TOKENS, HIDDEN, 4 if ranks[1] else 0)
        sent = 3 * wire_bytes(TOKENS, HIDDEN, 0) + last + (1 if wrong_bytes else 0)
        pipeline = max(timeline.flush_end)
        stages = [
            {
                "interstage_rank": r,
                "forward_s": M * f,
                "backward_s": M * b,
                "pipeline_s": pipeline,
                "interstage_s": slow * s,
                "interstage_wire_s": slow * wire if stage == 0 else 0.0,  # receiver
                "interstage_compress_s": slow * compress if stage == 1 else 0.0,
            }  # sender
            for stage, (r, f, b, s) in enumerate(zip(ranks, t_fwd, t_bwd, per_stage))
        ]
        lines.append(
            json.dumps(
                {
                    "kind": "train",
                    "step": step,
                    "rank": None,
                    "step_time_s": pipeline + 0.05,
                    "interstage_bytes_sent": sent,
                    "interstage_bytes_raw": M * TOKENS * HIDDEN * 4,
                    "interstage_time_s": slow * sum(per_stage),
                    "stages": stages,
                }
            )
        )
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "bench", run


def test_a_run_that_follows_the_model_is_predicted_exactly(tmp_path):
    _, run = write_bench(tmp_path)
    rows = calibrate_pipeline([load_run(run)], DEVICE, LINK)
    assert [r.ranks for r in rows] == [(None, None), (None, 4)]
    for r in rows:
        assert r.bytes_exact
        assert r.interstage_error == pytest.approx(0, abs=1e-9) and r.step_error == pytest.approx(0, abs=1e-9)
    raw_group, compressed = rows
    assert compressed.bytes_predicted < raw_group.bytes_predicted  # the cool-down's gradient went as factors
    assert compressed.wire_predicted_s < raw_group.wire_predicted_s  # its payload is smaller
    assert compressed.wire_error == pytest.approx(0, abs=1e-9) and compressed.compress_error == pytest.approx(
        0, abs=1e-9
    )
    assert raw_group.compress_predicted_s == 0 and compressed.compress_predicted_s > 0
    assert compressed.interstage_predicted_s != raw_group.interstage_predicted_s


def test_errors_and_byte_mismatches_show(tmp_path):
    _, run = write_bench(tmp_path, slow=1.25, wrong_bytes=True)
    rows = calibrate_pipeline([load_run(run)], DEVICE, LINK)
    assert all(not r.bytes_exact for r in rows)
    assert all(r.interstage_error == pytest.approx(1 / 1.25 - 1) for r in rows)
    assert all(r.wire_error == pytest.approx(1 / 1.25 - 1) for r in rows)
    text = format_pipeline_calibration(rows, LINK, DEVICE)
    assert "| NO |" in text and "-20.0%" in text


def test_plain_dp_runs_are_refused(tmp_path):
    _, run = write_bench(tmp_path)
    dp = tmp_path / "dp"
    dp.mkdir()
    (dp / "config.json").write_text(json.dumps({**CONFIG, "pp": 1}))
    (dp / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    with pytest.raises(ValueError, match="not a pipeline run"):
        calibrate_pipeline([load_run(run), load_run(dp)], DEVICE, LINK)


def test_cli_calibrate_reads_a_tp_pp_bench_folder(tmp_path, capsys):
    bench, _ = write_bench(tmp_path)
    profile = tmp_path / "host.json"
    save_profile(profile, DEVICE, LINK)
    assert main(["simulate", "--calibrate", str(bench), "--host-profile", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "| none | cooldown | -/4 | 10 |" in out and "| yes |" in out


def test_docs_script_fills_the_doc_section_and_the_results_page(tmp_path, load_producer):
    bench, _ = write_bench(tmp_path)
    (bench / "bench.md").write_text(
        "# edgc bench\n\n<!-- bench:start -->\n`edgc bench --tp 2 --pp 2` — 2 hosts × TP2 × "
        "PP2 …\n\n| method | … |\n<!-- bench:end -->\n"
    )
    profile = tmp_path / "host.json"
    save_profile(profile, DEVICE, LINK)
    docs, page = tmp_path / "simulate.md", tmp_path / "page.md"
    docs.write_text("intro\n<!-- interstage-calibration:start -->\nSTALE\n<!-- interstage-calibration:end -->\nafter\n")
    page.write_text("top\n<!-- bench-tp-table:start -->\nSTALE\n<!-- bench-tp-table:end -->\n")
    module = load_producer("interstage-calibration")
    assert module.main([str(bench), "--host-profile", str(profile), "--docs", str(docs), "--results", str(page)]) == 0
    doc = docs.read_text()
    assert "STALE" not in doc and doc.startswith("intro\n") and doc.endswith("after\n")
    assert "on the bench of `edgc bench --tp 2 --pp 2`" in doc and "| none | cooldown | -/4 |" in doc
    assert "predicted inter-stage bytes equal the measured ones in every group (2 groups of steps over 1 runs)" in doc
    assert re.search(r"inter-stage time error [+-]0\.0%( … [+-]0\.0%)?, payload transfer [+-]0\.0%", doc)
    text = page.read_text()
    assert "2 hosts × TP2 × PP2" in text and "STALE" not in text
    assert "<!-- interstage-calibration-line:start -->\nSimulator vs this bench" in text
