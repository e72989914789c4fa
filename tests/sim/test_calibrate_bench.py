"""Bench-mode calibration (`edgc simulate --calibrate <bench>/runs/*`) on a synthetic bench folder,
the link fit, and the collectives each method's step issues."""

import json
import math
from dataclasses import replace

import pytest

from edgc_cli.main import main
from edgc_sim.bench_link import BenchLink, bench_link, find_bench_calibration, fit_bench_link, nominal_link
from edgc_sim.calibrate import link_times, load_run
from edgc_sim.calibrate_bench import calibrate_bench
from edgc_sim.calibration_tables import format_bench_calibration
from edgc_sim.collectives import ddp_buckets, gpt2_gradient_shapes, step_collectives
from edgc_sim.hardware import DeviceSpec
from edgc_sim.presets import ModelSpec
from edgc_sim.step_model import compress_model, step_payloads, wire_parts, wire_time

DEVICE = DeviceSpec("host", {"fp32": 50e9}, 1.0, 10e9, 5e-6)
MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64, "vocab_size": 256}
ALPHA, BETA, BURST = 150e-6, 0.92 * 1000e6 / 8, 200e3  # per ring step; what tbf delivers; its burst
LINK = BenchLink(ALPHA, BETA, BURST)
COMPUTE, OMEGA = 0.5, 0.04  # reference compute; peer-wait share of the work
# the bench's small preset (8 x 512, vocab 4096, 512 positions), as `edgc train` builds it
SMALL = ModelSpec(8, 512, 8, 128, 4096, vocab_pad=1, positions=512)


def allreduce_time(nbytes, world=2):
    return 2 * (world - 1) * ALPHA + max(0.0, 2 * (world - 1) / world * nbytes - BURST) / BETA


def test_link_fit_recovers_alpha_and_beta():
    sizes = [mb * 2**20 for mb in (1 / 256, 1 / 16, 1 / 4, 1 / 2, 1, 4, 16, 64)]
    for world in (2, 4):
        alpha, beta = fit_bench_link(world, sizes, [allreduce_time(s, world) for s in sizes], BURST)
        assert alpha == pytest.approx(ALPHA, rel=1e-9) and beta == pytest.approx(BETA, rel=1e-9)
    # the old calibration (1-64 MiB only): the rate still, no latency
    large = sizes[4:]
    alpha, beta = fit_bench_link(2, large, [s / BETA for s in large])
    assert alpha == 0 and beta == pytest.approx(BETA)
    with pytest.raises(ValueError, match="two sizes"):
        fit_bench_link(2, sizes[:5], [allreduce_time(s) for s in sizes[:5]])


def test_ddp_buckets_of_the_bench_model_match_torch():
    # torch 2.13 DDP on the small preset (measured with a comm hook: bucket sizes in MiB, tensors)
    buckets = ddp_buckets(gpt2_gradient_shapes(SMALL))
    mib = [round(sum(math.prod(s) for s in b) * 4 / 2**20, 2) for b in buckets]
    assert mib == [4.01, 28.06, 25.06, 27.06, 21.03] and [len(b) for b in buckets] == [4, 26, 28, 26, 16]
    assert len(ddp_buckets(gpt2_gradient_shapes(SMALL), 500)) == 1  # torch-powersgd's bucket_cap_mb


def test_collectives_per_step_of_each_method():
    count = lambda method, rank=None: len(step_collectives(method, SMALL, rank))  # noqa: E731
    for method in ("none", "fp16", "bf16", "topk", "randomk", "qsgd8"):
        assert count(method) == 5  # one per DDP bucket
    assert count("powersgd", 8) == count("edgc", 2) == 15  # raw tensors, P, Q per bucket
    assert count("powersgd", None) == 5  # warm-up: uncompressed
    assert count("torch-powersgd", 8) == 3  # one 500 MB bucket: raw, P, Q
    # the payloads add up to what the runs logged as bytes_sent (runs/bench, torch 2.13)
    assert sum(step_collectives("none", SMALL, None)) == 110317568
    assert sum(step_collectives("powersgd", SMALL, 8)) == 2494484
    assert sum(step_collectives("edgc", SMALL, 4)) == 1355796
    assert sum(step_collectives("powersgd", SMALL, 2)) == 786452
    assert sum(step_collectives("torch-powersgd", SMALL, 8)) == 2494464


def config(compressor):
    return {
        "preset": "tiny",
        "world_size": 2,
        "micro_batch": 2,
        "seq_len": 32,
        "grad_accum": 1,
        "compressor": compressor,
        "powersgd_rank": 4,
        "model": MODEL,
    }


def write_bench(tmp_path, logged_collectives=None):
    """calibration.json measured on LINK, and runs whose times follow the bench model exactly;
    `logged_collectives`: method -> the `collectives` its metrics log (none: no such field)."""
    logged_collectives = logged_collectives or {}
    bench = tmp_path / "bench"
    (bench / "runs").mkdir(parents=True)
    (bench / "calibration.json").write_text(
        json.dumps(
            [
                {"mb": mb, "seconds": 9.0, "mean_s": allreduce_time(mb * 2**20), "burst_bytes": BURST}
                for mb in (1 / 256, 1 / 16, 1 / 2, 1.0, 4.0, 16.0)
            ]
        )
    )
    payload = {"none": (None, 400_000.0), "fp16": (None, 200_000.0), "powersgd": (4, 20_000.0)}
    for name, (rank, nbytes) in payload.items():
        run = bench / "runs" / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps(config(name)))
        compress = compress_model(name, rank, config(name), DEVICE)
        count = logged_collectives.get(name)
        comm = wire_time(name, 2, step_payloads(name, rank, config(name), nbytes), LINK, count)
        comm += OMEGA * (COMPUTE + compress)
        lines = []
        for step in range(1, 21):
            warm = rank is not None and step <= 4  # uncompressed warm-up: a different workload, ignored
            record = {
                "kind": "train",
                "step": step,
                "rank": None if warm else rank,
                "bytes_sent": 400_000 if warm else nbytes,
                "compute_time_s": COMPUTE,
                "compress_time_s": compress,
                "comm_time_s": 9.0 if warm else comm,
                "step_time_s": 9.0 if warm else COMPUTE + compress + comm,
            }
            if count is not None:
                record["collectives"] = 99 if warm else count
            lines.append(json.dumps(record))
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return bench


def test_bench_link_fits_calibration(tmp_path):
    bench = write_bench(tmp_path)
    link = bench_link(bench / "calibration.json")  # the mean times, not the (here bogus) medians
    assert link.bytes_per_s == pytest.approx(BETA, rel=1e-6) and link.alpha_s == pytest.approx(ALPHA, rel=1e-6)
    assert link.burst_bytes == BURST and "300 us per all-reduce" in link.source
    # an older calibration.json: medians of 1-64 MiB, burst from the rate of its bytes / rate bound
    old = tmp_path / "old.json"
    old.write_text(
        json.dumps(
            [{"mb": mb, "seconds": mb * 2**20 / BETA, "ideal_s": mb * 2**20 * 8 / 1e9} for mb in (1.0, 4.0, 16.0)]
        )
    )
    link = bench_link(old)
    assert link.alpha_s == 0 and link.burst_bytes == pytest.approx(250_000, abs=1) and "latency unknown" in link.source
    assert find_bench_calibration(sorted((bench / "runs").iterdir())) == (bench / "calibration.json").resolve()
    assert find_bench_calibration([tmp_path]) is None


def test_calibrate_bench_matches_its_own_model(tmp_path):
    bench = write_bench(tmp_path)
    runs = [load_run(d) for d in sorted((bench / "runs").iterdir())]
    rows = calibrate_bench(runs, DEVICE, bench_link(bench / "calibration.json"))
    assert [(r.run, r.rank, r.steps, r.collectives) for r in rows] == [
        ("fp16", None, 18, 1),
        ("none", None, 18, 1),
        ("powersgd", 4, 16, 3),
    ]  # the tiny model: one bucket
    for r in rows:  # warm-up steps (rank None in a compressed run) and the first 10% are left out
        assert r.comm_error == pytest.approx(0, abs=1e-9) and r.step_error == pytest.approx(0, abs=1e-9)
        assert not r.collectives_measured and not r.link_measured and math.isnan(r.link_error)  # no traces
        assert r.latency_s == pytest.approx(r.collectives * 2 * ALPHA)
    assert rows[2].bytes_sent == 20_000 and rows[2].compress_modelled
    table = format_bench_calibration(rows, nominal_link(1000), DEVICE)
    assert "+0.0% (ref)" in table and table.count("| powersgd | 4 |") == 1 and "3 (pattern)" in table
    with pytest.raises(ValueError, match="uncompressed run"):
        calibrate_bench(runs[2:], DEVICE, nominal_link(1000))


def test_calibrated_prediction_uses_the_logged_collectives(tmp_path):
    # powersgd's metrics log 7 collectives per step (say, decisions), not its pattern's 3
    bench = write_bench(tmp_path, {"powersgd": 7})
    runs = [load_run(d) for d in sorted((bench / "runs").iterdir())]
    rows = {r.run: r for r in calibrate_bench(runs, DEVICE, LINK)}
    row = rows["powersgd"]
    assert row.collectives == 7 and row.collectives_measured
    assert row.latency_s == pytest.approx(7 * 2 * ALPHA) and row.comm_error == pytest.approx(0, abs=1e-9)
    payloads = step_payloads("powersgd", 4, config("powersgd"), 20_000.0)
    latency, transfer = wire_parts("powersgd", 2, payloads, LINK)  # the pattern: 3
    assert latency == pytest.approx(3 * 2 * ALPHA)
    assert row.comm_predicted_s - row.wait_s == pytest.approx(latency + transfer + 4 * 2 * ALPHA)


def test_link_times_take_each_collectives_minimum_over_ranks():
    # rank 0 waited 5 in the first collective, rank 1 waited 3 in the second: the link took 1 + 2
    traces = [{1: [6.0, 2.0], 2: [1.0], 3: [1.0, 1.0]}, {1: [1.0, 5.0], 2: [1.0], 4: [9.0]}]
    assert link_times(traces) == {1: 3.0, 2: 1.0}  # step 3/4: not on both ranks
    assert link_times([{1: [1.0, 2.0]}, {1: [1.0]}]) == {}  # different counts: not comparable
    assert link_times([]) == {}


def test_calibration_compares_the_model_with_the_traced_link_time(tmp_path):
    bench = write_bench(tmp_path)
    run = bench / "runs" / "powersgd"
    payloads = step_payloads("powersgd", 4, config("powersgd"), 20_000.0)
    on_link = [LINK.collective_s(2, p) for p in payloads]
    wait = [0.010, 0.0, 0.004]  # who waits, and how long, differs per collective
    (run / "comm_trace").mkdir()
    for k in (0, 1):
        lines = [
            json.dumps(
                {
                    "step": step,
                    "collective_s": [t + (w if (i + k) % 2 else 0.0) for i, (t, w) in enumerate(zip(on_link, wait))],
                }
            )
            for step in range(1, 21)
        ]
        (run / "comm_trace" / f"rank{k}.jsonl").write_text("\n".join(lines) + "\n")
    rows = {r.run: r for r in calibrate_bench([load_run(d) for d in sorted((bench / "runs").iterdir())], DEVICE, LINK)}
    row = rows["powersgd"]
    assert row.link_measured and row.link_measured_s == pytest.approx(sum(on_link))
    assert row.link_predicted_s == pytest.approx(sum(on_link)) and row.link_error == pytest.approx(0, abs=1e-9)
    assert row.link_ci_s == pytest.approx((sum(on_link), sum(on_link)))
    assert replace(row, link_ci_s=(0.0, 1.0)).link_in_ci and not replace(row, link_ci_s=(1.0, 2.0)).link_in_ci
    table = format_bench_calibration(list(rows.values()), LINK, DEVICE)
    assert table.count("| - | - | -") == 2  # the untraced runs: no link measurement
    (run / "comm_trace" / "rank1.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="not a comm trace"):
        load_run(run)


def write_trace(run, per_collective):
    """Both ranks trace every step's collectives at the link model's time plus `per_collective` each
    (a fixed cost the sweep did not see); rank 1 also waits 5 ms in the first."""
    payloads = step_payloads("powersgd", 4, config("powersgd"), 20_000.0)
    on_link = [LINK.collective_s(2, p) + per_collective for p in payloads]
    (run / "comm_trace").mkdir()
    for k in (0, 1):
        lines = [
            json.dumps(
                {"step": step, "collective_s": [t + (0.005 if k and not i else 0.0) for i, t in enumerate(on_link)]}
            )
            for step in range(1, 21)
        ]
        (run / "comm_trace" / f"rank{k}.jsonl").write_text("\n".join(lines) + "\n")
    return sum(on_link)


def test_traced_latency_leaves_the_predicted_run_out(tmp_path):
    import shutil

    bench = write_bench(tmp_path)
    runs_dir = bench / "runs"
    shutil.copytree(runs_dir / "powersgd", runs_dir / "powersgd-b")
    extra = {"powersgd": 0.001, "powersgd-b": 0.002}  # each run's collectives cost this much more than the sweep says
    measured = {name: write_trace(runs_dir / name, e) for name, e in extra.items()}
    runs = [load_run(d) for d in sorted(runs_dir.iterdir())]
    rows = {r.run: r for r in calibrate_bench(runs, DEVICE, LINK)}
    sweep_fixed = 2 * ALPHA
    for name, other in (("powersgd", "powersgd-b"), ("powersgd-b", "powersgd")):
        row = rows[name]
        # the fixed cost comes from the other run's trace alone: 3 collectives x (sweep's + other's extra)
        assert row.latency_from == f"traced: {other}"
        assert row.latency_s == pytest.approx(3 * (sweep_fixed + extra[other]))
        assert row.link_measured_s == pytest.approx(measured[name])  # rank 1's wait is not the link's
        assert row.link_error == pytest.approx(3 * (extra[other] - extra[name]) / measured[name])
        assert row.link_sweep_error == pytest.approx(-3 * extra[name] / measured[name])
    # untraced runs learn from every latency-bound traced run
    assert rows["none"].latency_from == "traced: powersgd, powersgd-b"
    assert rows["none"].latency_s == pytest.approx(sweep_fixed + 0.0015)
    # a run's own trace never moves its own prediction
    shutil.rmtree(runs_dir / "powersgd" / "comm_trace")
    write_trace(runs_dir / "powersgd", 0.050)
    again = {r.run: r for r in calibrate_bench([load_run(d) for d in sorted(runs_dir.iterdir())], DEVICE, LINK)}
    assert again["powersgd"].link_predicted_s == pytest.approx(rows["powersgd"].link_predicted_s)
    assert again["powersgd-b"].latency_s == pytest.approx(3 * (sweep_fixed + 0.050))
    # the sweep on request; alone when no other run is traced
    swept = {r.run: r for r in calibrate_bench(runs, DEVICE, LINK, latency="sweep")}
    assert all(
        r.latency_from == "sweep" and r.latency_s == pytest.approx(r.collectives * sweep_fixed) for r in swept.values()
    )
    table = format_bench_calibration(list(rows.values()), LINK, DEVICE)
    assert "(traced)" in table and "fixed cost per collective of powersgd r=4: traced in powersgd-b" in table
    with pytest.raises(ValueError, match="latency must be one of"):
        calibrate_bench(runs, DEVICE, LINK, latency="guess")


def test_bandwidth_bound_traces_do_not_teach_the_latency(tmp_path):
    bench = write_bench(tmp_path)
    run = bench / "runs" / "none"
    payloads = step_payloads("none", None, config("none"), 400_000.0)
    (run / "comm_trace").mkdir()
    for k in (0, 1):  # bytes are most of this link time: a wrong rate would pass for latency
        (run / "comm_trace" / f"rank{k}.jsonl").write_text(
            "".join(
                json.dumps({"step": s, "collective_s": [LINK.collective_s(2, p) + 1e-4 for p in payloads]}) + "\n"
                for s in range(1, 21)
            )
        )
    rows = {r.run: r for r in calibrate_bench([load_run(d) for d in sorted((bench / "runs").iterdir())], DEVICE, LINK)}
    assert {r.latency_from for r in rows.values()} == {"sweep"}
    # but the reference's traced link time is what its comm has beyond the peer wait
    assert rows["none"].wait_s == pytest.approx(OMEGA * COMPUTE - len(payloads) * 1e-4)


def test_cli_calibrate_bench(tmp_path, capsys):
    bench = write_bench(tmp_path)
    profile = tmp_path / "host.json"
    profile.write_text(json.dumps({"device": DEVICE.__dict__, "link": None}))
    dirs = [str(d) for d in sorted((bench / "runs").iterdir())]
    assert main(["simulate", "--calibrate", *dirs, "--host-profile", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "fit of" in out and "| none | - | 18 |" in out
    assert main(["simulate", "--calibrate", *dirs, "--host-profile", str(profile), "--latency", "sweep"]) == 0
    assert "the link sweep's" in capsys.readouterr().out
    assert main(["simulate", "--calibrate", *dirs, "--host-profile", str(profile), "--link-mbit", "920"]) == 0
    assert "nominal 920 Mbit/s" in capsys.readouterr().out


def test_docs_script_regenerates_docs_and_the_results_page(tmp_path, capsys, load_producer):
    module = load_producer("calibration")
    bench = write_bench(tmp_path)
    (bench / "runs" / "powersgd").rename(bench / "runs" / "powersgd-rmax")
    profile = tmp_path / "host.json"
    profile.write_text(json.dumps({"device": DEVICE.__dict__, "link": None}))
    page, docs = tmp_path / "page.md", tmp_path / "calibration.md"
    page.write_text("# x\n\n<!-- calibration-table:start -->\nold\n<!-- calibration-table:end -->\n\ntail\n")
    args = [str(bench), "--host-profile", str(profile), "--results", str(page), "--docs", str(docs)]
    assert module.main(args) == 0
    text = page.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| powersgd-rmax | 4 | 3 (pattern) |"))
    assert "old" not in text and text.endswith("tail\n") and "| +0.0 % |" in row
    assert "rank-0 comm time (with peer wait) within 15%: none, fp16, powersgd-rmax r=4; outside: none." in text
    assert "link time" not in text  # no run was traced
    assert "scripts/to_docs.py calibration " + " ".join(args) in docs.read_text()
    assert module.main(args) == 0 and page.read_text() == text  # idempotent


def test_median_interval_brackets_the_median_and_narrows_with_more_steps():
    import random
    import statistics

    from edgc_sim.step_model import median_interval

    rng = random.Random(3)
    few = [rng.uniform(0.01, 0.25) for _ in range(20)]
    many = few + [rng.uniform(0.01, 0.25) for _ in range(480)]
    low, high = median_interval(few)
    assert low <= statistics.median(few) <= high
    assert median_interval(few) == (low, high)  # seeded: a regenerated table is identical
    assert median_interval(many)[1] - median_interval(many)[0] < (high - low) / 2
    assert median_interval([0.05] * 10) == (0.05, 0.05)


# ---------------------------------------------------------------------------------- issue-15 folders
def test_step_timeline_overlaps_all_but_the_tail():
    from edgc_sim.step_model import OTHER_SHARE, step_timeline

    compute, compress, values = 1.0, 0.3, [1, 2, 2, 2, 1]
    before = compute * (1 - OTHER_SHARE)
    # a free link: nothing exposed, whatever the mode
    for mode in ("hook", "native", "blocking"):
        t = step_timeline(compute, compress, [[0.0]] * 5, values, mode)
        assert t.end_s == pytest.approx(before + compress) and t.exposed_s == pytest.approx(0)
    # blocking: every collective adds up (the old model's sum)
    durations = [[0.01, 0.02, 0.01]] * 5
    blocking = step_timeline(compute, compress, durations, values, "blocking")
    assert blocking.end_s == pytest.approx(before + compress + 0.2)
    # our hook: the others hide behind backward; the last bucket's collectives are exposed, less what
    # the host meanwhile spends finishing the earlier buckets' jobs
    hook = step_timeline(compute, compress, durations, values, "hook")
    assert 0 < hook.exposed_s < 0.04 and hook.end_s < blocking.end_s
    # no compress: the previous bucket's Q (issued at the last hook) and the last bucket's three
    assert step_timeline(compute, 0.0, durations, values, "hook").exposed_s == pytest.approx(0.01 + 0.04)
    # a link slower than backward: everything but what backward covers is exposed
    slow = [[0.5]] * 5
    native = step_timeline(compute, 0.0, slow, values, "native")
    assert native.end_s == pytest.approx(compute * 0.3 + compute * 0.6 / 8 + 2.5)
    assert step_timeline(compute, 0.0, [], [], "native").end_s == pytest.approx(before)  # nosync
    with pytest.raises(ValueError):
        step_timeline(compute, 0.0, slow, values, "overlap")


def write_bench15(tmp_path):
    """An issue-15 bench folder (none = DDP native, nosync, allreduce, allreduce-blocking, powersgd)
    whose step times follow the model exactly."""
    from edgc_sim.calibrate import harness_model
    from edgc_sim.collectives import bucket_values
    from edgc_sim.step_model import OTHER_SHARE, payload_groups, step_timeline

    bench = tmp_path / "bench15"
    (bench / "runs").mkdir(parents=True)
    (bench / "calibration.json").write_text(
        json.dumps(
            [
                {"mb": mb, "seconds": 9.0, "mean_s": allreduce_time(mb * 2**20), "burst_bytes": BURST}
                for mb in (1 / 256, 1 / 16, 1 / 2, 1.0, 4.0, 16.0)
            ]
        )
    )
    full = 400_000.0
    runs = {
        "none": (None, full, "native"),
        "nosync": (None, 0.0, None),
        "allreduce": (None, full, "hook"),
        "allreduce-blocking": (None, full, "sum"),
        "powersgd": (4, 20_000.0, "hook"),
    }
    for name, (rank, nbytes, mode) in runs.items():
        cfg = config(name)
        run = bench / "runs" / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps(cfg))
        compress = compress_model(name, rank, cfg, DEVICE)
        wait = 0.0 if name == "nosync" else OMEGA * (COMPUTE + compress)
        if mode in ("native", "hook"):
            durations = [[LINK.collective_s(2, p) for p in g] for g in payload_groups(name, rank, cfg, nbytes)]
            t = step_timeline(COMPUTE, compress, durations, bucket_values(name, harness_model(cfg)), mode)
            step, comm = t.end_s + COMPUTE * OTHER_SHARE + wait, t.comm_s + wait
        else:
            comm = wire_time(name, 2, step_payloads(name, rank, cfg, nbytes), LINK) + wait
            step = COMPUTE + compress + comm
        untimed = name in ("none", "nosync")
        lines = [
            json.dumps(
                {
                    "kind": "train",
                    "step": s,
                    "rank": rank,
                    "bytes_sent": nbytes,
                    "compute_time_s": step if untimed else COMPUTE,
                    "compress_time_s": 0.0 if untimed else compress,
                    "comm_time_s": 0.0 if untimed else comm,
                    "step_time_s": step,
                }
            )
            for s in range(1, 21)
        ]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return bench


def test_calibrate_issue15_bench(tmp_path, capsys):
    bench = write_bench15(tmp_path)
    runs = [load_run(d) for d in sorted((bench / "runs").iterdir())]
    rows = {r.run: r for r in calibrate_bench(runs, DEVICE, LINK, "sweep")}
    for name, row in rows.items():
        assert row.step_error == pytest.approx(0, abs=1e-9), name
    assert rows["none"].step_model == "native" and rows["allreduce"].step_model == "hook"
    assert rows["powersgd"].step_model == "hook" and rows["allreduce-blocking"].step_model == "sum"
    assert math.isnan(rows["none"].comm_error) and math.isnan(rows["nosync"].comm_error)  # no timer
    assert rows["allreduce"].comm_error == pytest.approx(0, abs=1e-9)
    # overlapped: DDP's native all-reduce beats the blocking one, the compute floor beats both
    assert rows["nosync"].step_predicted_s < rows["none"].step_predicted_s < rows["allreduce-blocking"].step_predicted_s
    assert step_collectives("allreduce-blocking", SMALL, None) == [sum(step_collectives("none", SMALL, None))]
    assert step_collectives("nosync", SMALL, None) == []
    # `edgc simulate --calibrate BENCHDIR` takes the bench folder itself
    profile = tmp_path / "host.json"
    profile.write_text(json.dumps({"device": DEVICE.__dict__, "link": None}))
    assert main(["simulate", "--calibrate", str(bench), "--host-profile", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "| allreduce | - |" in out and "(hook)" in out and "(native)" in out
