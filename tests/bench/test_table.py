"""The bench's comparison table and its time-to-target breakdown, on synthetic runs (no network)."""

import pytest

from edgc_bench import table, targets


def run(losses, step_s, comm_s, compress_s, phases=None, entropy_s=0.0, eval_s=1.0):
    """Five steps per evaluation; wall time = steps + one ``eval_s`` per evaluation."""
    train, evals, wall = [], [], 0.0
    for step in range(1, 5 * len(losses) + 1):
        seconds = step_s(step) if callable(step_s) else step_s
        wall += seconds
        phase = phases(step) if phases else "compress"
        train.append(
            {
                "step": step,
                "wall_s": wall,
                "step_time_s": seconds,
                "comm_time_s": comm_s,
                "compress_time_s": compress_s,
                "compute_time_s": seconds - comm_s - compress_s,
                "entropy_time_s": entropy_s,
                "phase": phase,
                "rank": 4,
                "bytes_sent": 100,
                "tokens_per_s": 1 / seconds,
            }
        )
        if step % 5 == 0:
            wall += eval_s
            evals.append({"step": step, "wall_s": wall, "val_loss": losses[step // 5 - 1], "val_ppl": 1.0})
    return {"train": train, "eval": evals}


def test_time_to_target_and_its_breakdown_add_up():
    results = {
        "none": run([3.0, 2.5, 2.0], step_s=2.0, comm_s=1.0, compress_s=0.0),
        "edgc": run(
            [2.9, 2.01, 1.9],
            step_s=1.0,
            comm_s=0.1,
            compress_s=0.3,
            entropy_s=0.05,
            phases=lambda step: "profile" if step <= 3 else "compress",
        ),
        "powersgd@rmax": run([2.9, 2.3, 2.1], step_s=0.9, comm_s=0.1, compress_s=0.2),
    }
    rows = {r["method"]: r for r in table.rows(results, r_max=8)}
    # target = 2.0 × 1.01 = 2.02: EDGC reaches it at its 2nd evaluation (step 10), PowerSGD at its 3rd
    assert rows["edgc"]["time_to_target_s"] == 10 * 1.0 + 2 * 1.0
    assert rows["powersgd@rmax"]["time_to_target_s"] is None
    assert rows["edgc"]["step_s_x"] == 0.5 and rows["none"]["step_s_x"] == 1.0

    breakdown = targets.target_breakdown(results).splitlines()
    edgc = [cell.strip() for cell in breakdown[2].split("|")[1:-1]]
    assert edgc == ["edgc", "10", "12.0 s", "6.0 s", "3.0 s", "0.5 s", "0.9 s", "1.0 s", "2.0 s"]
    assert len(breakdown) == 3  # PowerSGD never reached the target: no row

    checks = table.checks(list(rows.values()), r_max=8)
    assert any("time to target" in c and c.endswith("holds") for c in checks)


def test_the_floor_target_follows_the_link_rate():
    assert table.floor_target(1000) == table.floor_target(None) == 1.15  # factors hide behind backward
    assert table.floor_target(100) == 1.25 and table.floor_target(1000, fsdp=True) == 1.25
    rows = [{"method": "edgc", "step_floor_x": 1.19, "step_s_x": 0.6, "val_loss": 5.0}]
    line = next(c for c in table.checks(rows, r_max=8, rate_mbit=1000) if "compute floor" in c)
    assert line.endswith("(target ≤ 1.15×): MISSED")
    line = next(c for c in table.checks(rows, r_max=8, rate_mbit=100) if "compute floor" in c)
    assert line.endswith("(target ≤ 1.25×): holds")


def test_recoverable_bound_weighs_edgc_overhead_against_what_a_lower_rank_saves():
    profile_then_warmup = lambda step: "profile" if step <= 2 else ("warmup" if step <= 4 else "compress")  # noqa: E731
    results = {
        "none": run([3.0, 2.5, 2.0], step_s=2.0, comm_s=1.0, compress_s=0.0),
        "edgc": run(
            [2.9, 2.01, 1.9],
            step_s=lambda step: 3.0 if step <= 2 else 1.0,
            comm_s=0.1,
            compress_s=0.3,
            entropy_s=0.05,
            phases=profile_then_warmup,
        ),
        "powersgd@rmax": run(
            [2.9, 2.01, 2.1],
            step_s=1.0,
            comm_s=0.1,
            compress_s=0.2,
            phases=lambda step: "warmup" if step <= 2 else "compress",
        ),
    }
    # EDGC: two profiling steps 2 s above static's (warm-up) steps + entropy in steps 3..10 (8 × 0.05) = 4.4 s;
    # without r_min or the floor, the bound is static's DP comm in its compressed steps 3..10: 0.8 s
    line = targets.recoverable_bound(results)
    assert "was 4.4 s" in line and "same, uncompressed steps 4.0 s, entropy sampling 0.4 s" in line
    assert "is 0.8 s (static PowerSGD's whole DP comm time" in line and "EDGC cannot recover" in line
    results["nosync"] = run([3.0, 3.0, 3.0], step_s=0.3, comm_s=0.0, compress_s=0.0)  # 8 × 0.7 above it
    results["powersgd@rmin"] = run([3.0, 3.0, 3.0], step_s=0.9, comm_s=0.1, compress_s=0.1)  # 8 × 0.1
    line = targets.recoverable_bound(results)
    assert "is 0.8 s (static PowerSGD at r_min's median step instead of r_max's, over static's 8" in line
    results["powersgd@rmin"] = run([3.0, 3.0, 3.0], step_s=0.2, comm_s=0.1, compress_s=0.1)  # floor is tighter
    line = targets.recoverable_bound(results)
    assert (
        "is 5.6 s (static's compressed steps brought down to the compute floor)" in line and "EDGC can recover" in line
    )
    results["powersgd@rmax"] = run([2.01, 2.0, 2.0], step_s=0.9, comm_s=0.5, compress_s=0.2)
    assert targets.recoverable_bound(results) is not None  # static needs fewer steps: the bound still holds
    results["edgc"], results["powersgd@rmax"] = results["powersgd@rmax"], results["edgc"]
    assert targets.recoverable_bound(results) is None  # EDGC needed fewer steps: not a question of overhead


def test_ab_script_compares_the_methods_both_folders_ran(tmp_path, load_producer):
    import json

    module = load_producer("bench-ab")

    def folder(name, step, mb):
        path = tmp_path / name
        path.mkdir()
        rows = [
            {"method": "none", "step_s": step, "bytes_per_step": mb * 1e6, "val_loss": 6.0},
            {"method": f"only-{name}", "step_s": 1.0, "bytes_per_step": 1.0, "val_loss": 6.0},
        ]
        path.joinpath("results.json").write_text(
            json.dumps(
                {
                    "command": f"edgc bench --out {name}",
                    "date": "today",
                    "load_start": [1.0],
                    "load_end": [2.0],
                    "rows": rows,
                }
            )
        )
        return path

    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- ab:start -->\nold\n<!-- ab:end -->\nrest\n")
    assert (
        module.main(
            [
                str(folder("a", 1.0, 30.0)),
                str(folder("b", 1.25, 30.0)),
                "--label-a",
                "old",
                "--label-b",
                "new",
                "--marker",
                "ab",
                "--doc",
                str(doc),
            ]
        )
        == 0
    )
    text = doc.read_text()
    assert "| none | 1.000 | 1.250 | 1.25× | 30.00 | 30.00 |" in text
    assert "only-a" not in text and "old\n<!-- ab:end" not in text and text.endswith("rest\n")


def write_bench(folder, results, rate_mbit=1000, fsdp=False):
    """A finished bench's folder as `edgc bench` leaves it: results.json and one run folder per method."""
    import json

    from edgc_bench.bench_folder import method_dir

    for method, run_ in results.items():
        path = method_dir(folder, method)
        path.mkdir(parents=True)
        records = [{"kind": "train", **r} for r in run_["train"]] + [{"kind": "eval", **r} for r in run_["eval"]]
        path.joinpath("metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
        path.joinpath("config.json").write_text("{}")
    settings = {"rate_mbit": rate_mbit, "fsdp": fsdp, "tp": 1, "pp": 1}
    folder.joinpath("results.json").write_text(
        json.dumps(
            {
                "settings": settings,
                "rows": [{"method": m} for m in results],
                "r_max": 8,
                "date": "today",
                "load_start": [0.5, 0.5, 0.5],
            }
        )
    )
    return folder


def test_repeats_put_runs_side_by_side_and_count_the_targets_met(tmp_path):
    from edgc_bench import repeats

    warm_then_compress = lambda step: "warmup" if step <= 2 else "compress"  # noqa: E731
    base = {
        "none": run([3.0, 2.5, 2.0], step_s=2.0, comm_s=1.0, compress_s=0.0),
        "nosync": run([3.0, 3.0, 3.0], step_s=0.8, comm_s=0.0, compress_s=0.0),
        "powersgd@rmax": run([2.9, 2.01, 2.1], step_s=1.0, comm_s=0.1, compress_s=0.2, phases=warm_then_compress),
        "powersgd@rmin": run([3.0, 3.0, 3.0], step_s=0.95, comm_s=0.1, compress_s=0.1),
    }
    fast = dict(base, edgc=run([2.9, 2.01, 1.9], step_s=0.9, comm_s=0.1, compress_s=0.2, phases=warm_then_compress))
    slow = dict(base, edgc=run([2.9, 2.01, 1.9], step_s=1.1, comm_s=0.1, compress_s=0.2, phases=warm_then_compress))
    paths = [
        write_bench(tmp_path / "a", fast),
        write_bench(tmp_path / "b", slow),
        write_bench(tmp_path / "c", slow, rate_mbit=100),
        write_bench(tmp_path / "h", fast, fsdp=True),
    ]
    with (tmp_path / "a" / "runs" / "edgc" / "metrics.jsonl").open("a") as metrics:  # as `edgc train` logs it
        metrics.write('\n{"kind": "profiled", "step": 2, "event": "edgc_found", "uncompressed_is_bound": true}\n')
    text = repeats.render(paths)
    rows = [line for line in text.splitlines() if line.startswith("| a |") or line.startswith("| b |")]
    assert "| quick test | 1.125 | 1.250 | 0.900 | 11.0 s / 12.0 s |" in rows[0]
    assert "| unknown | 1.375 |" in rows[1]  # 0.9 / 0.8, 1.0 / 0.8; 10 steps + 2 evaluations
    assert "| 1.375 | 1.250 | 1.100 | 13.0 s / 12.0 s |" in rows[1]
    assert (
        "1000 Mbit/s, r_max by quick test, 1 run(s): EDGC × floor 1.125–1.125 (≤ 1.15 in 1 of 1); "
        "EDGC ÷ static step 0.900–0.900; time to target below static PowerSGD at r_max's in 1 of 1"
    ) in text
    assert "1000 Mbit/s, r_max by unknown, 1 run(s): EDGC × floor 1.375–1.375 (≤ 1.15 in 0 of 1)" in text
    assert "100 Mbit/s, r_max by unknown, 1 run(s): EDGC × floor 1.375–1.375 (≤ 1.25 in 0 of 1)" in text
    assert text.index("1000 Mbit/s, r_max by quick") < text.index("100 Mbit/s, r_max")  # fastest link first
    assert "skipped (not a DDP bench with edgc, powersgd@rmax and nosync): h" in text


def test_repeats_script_replaces_only_its_block(tmp_path, load_producer):
    module = load_producer("bench-repeats")
    fast = {
        "none": run([3.0, 2.5, 2.0], step_s=2.0, comm_s=1.0, compress_s=0.0),
        "nosync": run([3.0, 3.0, 3.0], step_s=0.8, comm_s=0.0, compress_s=0.0),
        "powersgd@rmax": run([2.9, 2.01, 2.1], step_s=1.0, comm_s=0.1, compress_s=0.2),
        "edgc": run([2.9, 2.01, 1.9], step_s=0.9, comm_s=0.1, compress_s=0.2),
    }
    bench = write_bench(tmp_path / "bench-a", fast)
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- bench-repeats:start -->\nold\n<!-- bench-repeats:end -->\nrest\n")
    module.write_view([str(bench)], page)
    text = page.read_text()
    assert "| bench-a | today | 1000 Mbit/s | 0.5 | unknown | 1.125 | 1.250 | 0.900 |" in text
    assert text.startswith("intro\n<!-- bench-repeats:start -->\n`python -m edgc_bench.repeats ")
    assert "old" not in text and text.endswith("<!-- bench-repeats:end -->\nrest\n")

    # A second machine's runs go to their own block; the first view stays as it was.
    page.write_text(text + "<!-- bench-repeats-vm2:start -->\nold\n<!-- bench-repeats-vm2:end -->\n")
    module.write_view([str(bench)], page, block="bench-repeats-vm2")
    second = page.read_text()
    assert second.startswith(text) and "old" not in second
    assert second.count("| bench-a | today |") == 2
    with pytest.raises(SystemExit, match="no <!-- missing:start -->"):
        module.write_view([str(bench)], page, block="missing")
