"""The bench's comparison table and its time-to-target breakdown, on synthetic runs (no network)."""
from edgc_bench import table


def run(losses, step_s, comm_s, compress_s, phases=None, entropy_s=0.0, eval_s=1.0):
    """Five steps per evaluation; wall time = steps + one ``eval_s`` per evaluation."""
    train, evals, wall = [], [], 0.0
    for step in range(1, 5 * len(losses) + 1):
        seconds = step_s(step) if callable(step_s) else step_s
        wall += seconds
        phase = phases(step) if phases else "compress"
        train.append({"step": step, "wall_s": wall, "step_time_s": seconds, "comm_time_s": comm_s,
                      "compress_time_s": compress_s, "compute_time_s": seconds - comm_s - compress_s,
                      "entropy_time_s": entropy_s, "phase": phase, "rank": 4, "bytes_sent": 100,
                      "tokens_per_s": 1 / seconds})
        if step % 5 == 0:
            wall += eval_s
            evals.append({"step": step, "wall_s": wall, "val_loss": losses[step // 5 - 1], "val_ppl": 1.0})
    return {"train": train, "eval": evals}


def test_time_to_target_and_its_breakdown_add_up():
    results = {
        "none": run([3.0, 2.5, 2.0], step_s=2.0, comm_s=1.0, compress_s=0.0),
        "edgc": run([2.9, 2.01, 1.9], step_s=1.0, comm_s=0.1, compress_s=0.3, entropy_s=0.05,
                    phases=lambda step: "profile" if step <= 3 else "compress"),
        "powersgd@rmax": run([2.9, 2.3, 2.1], step_s=0.9, comm_s=0.1, compress_s=0.2),
    }
    rows = {r["method"]: r for r in table.rows(results, r_max=8)}
    # target = 2.0 × 1.01 = 2.02: EDGC reaches it at its 2nd evaluation (step 10), PowerSGD at its 3rd
    assert rows["edgc"]["time_to_target_s"] == 10 * 1.0 + 2 * 1.0
    assert rows["powersgd@rmax"]["time_to_target_s"] is None
    assert rows["edgc"]["step_s_x"] == 0.5 and rows["none"]["step_s_x"] == 1.0

    breakdown = table.target_breakdown(results).splitlines()
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
        "edgc": run([2.9, 2.01, 1.9], step_s=lambda step: 3.0 if step <= 2 else 1.0, comm_s=0.1, compress_s=0.3,
                    entropy_s=0.05, phases=profile_then_warmup),
        "powersgd@rmax": run([2.9, 2.01, 2.1], step_s=1.0, comm_s=0.1, compress_s=0.2,
                             phases=lambda step: "warmup" if step <= 2 else "compress"),
    }
    # EDGC: two profiling steps 2 s above static's (warm-up) steps + entropy in steps 3..10 (8 × 0.05) = 4.4 s;
    # without r_min or the floor, the bound is static's DP comm in its compressed steps 3..10: 0.8 s
    line = table.recoverable_bound(results)
    assert "was 4.4 s" in line and "same, uncompressed steps 4.0 s, entropy sampling 0.4 s" in line
    assert "is 0.8 s (static PowerSGD's whole DP comm time" in line and "EDGC cannot recover" in line
    results["nosync"] = run([3.0, 3.0, 3.0], step_s=0.3, comm_s=0.0, compress_s=0.0)  # 8 × 0.7 above it
    results["powersgd@rmin"] = run([3.0, 3.0, 3.0], step_s=0.9, comm_s=0.1, compress_s=0.1)  # 8 × 0.1
    line = table.recoverable_bound(results)
    assert "is 0.8 s (static PowerSGD at r_min's median step instead of r_max's, over static's 8" in line
    results["powersgd@rmin"] = run([3.0, 3.0, 3.0], step_s=0.2, comm_s=0.1, compress_s=0.1)  # floor is tighter
    line = table.recoverable_bound(results)
    assert "is 5.6 s (static's compressed steps brought down to the compute floor)" in line and "EDGC can recover" in line
    results["powersgd@rmax"] = run([2.01, 2.0, 2.0], step_s=0.9, comm_s=0.5, compress_s=0.2)
    assert table.recoverable_bound(results) is not None  # static needs fewer steps: the bound still holds
    results["edgc"], results["powersgd@rmax"] = results["powersgd@rmax"], results["edgc"]
    assert table.recoverable_bound(results) is None  # EDGC needed fewer steps: not a question of overhead


def test_ab_script_compares_the_methods_both_folders_ran(tmp_path, load_script):
    import json

    module = load_script("bench_ab_to_docs")

    def folder(name, step, mb):
        path = tmp_path / name
        path.mkdir()
        rows = [{"method": "none", "step_s": step, "bytes_per_step": mb * 1e6, "val_loss": 6.0},
                {"method": f"only-{name}", "step_s": 1.0, "bytes_per_step": 1.0, "val_loss": 6.0}]
        path.joinpath("results.json").write_text(json.dumps(
            {"command": f"edgc bench --out {name}", "date": "today", "load_start": [1.0], "load_end": [2.0], "rows": rows}))
        return path

    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- ab:start -->\nold\n<!-- ab:end -->\nrest\n")
    assert module.main([str(folder("a", 1.0, 30.0)), str(folder("b", 1.25, 30.0)), "--label-a", "old",
                        "--label-b", "new", "--marker", "ab", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "| none | 1.000 | 1.250 | 1.25× | 30.00 | 30.00 |" in text
    assert "only-a" not in text and "old\n<!-- ab:end" not in text and text.endswith("rest\n")
