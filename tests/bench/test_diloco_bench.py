"""`edgc bench --diloco` without a network: the measures taken from the workers' logs, the tables and
checks on synthetic runs, the results page routing, the flag checks, the streaming fragments, and
three workers training DiLoCo + EDGC through a lighthouse on loopback."""

import argparse
import json
from datetime import timedelta
from pathlib import Path

import pytest

from edgc_bench import diloco_table
from edgc_bench.cli import diloco
from edgc_bench.run import BenchSettings
from edgc_cli.errors import CLIError

ROOT = Path(__file__).resolve().parents[2]


def write_run(
    run_dir: Path,
    unit: int,
    steps: int = 20,
    step_s: float = 0.5,
    sync_s: float = 1.0,
    payload: int = 1000,
    loss_at=lambda step: 8.0 - step / 10,
    hosts: int = 3,
    skip=(),
    kill=None,
    wire: int | None = None,
    shapes: list | None = None,
) -> None:
    """Logs as diloco_train.py writes them: a sync every ``unit`` inner steps; group 0 evaluates every
    sync. ``skip``: (group, outer) pairs a group sat out; ``kill``: (time, outer) when group 1 died, the
    survivors discarding that outer step and the restarted group back one outer step later."""
    run_dir.mkdir(parents=True)
    for group in range(hosts):
        lines, t, clock = [{"kind": "start", "pid": 1, "t": 0.0, "restart": 0}], 0.0, 0.0
        if shapes is not None:
            lines.append({"kind": "model", "shapes": shapes})
        evals = [{"kind": "eval", "step": 0, "clock": 0.0, "val_loss": loss_at(0)}]
        outer = 0
        for step in range(steps):
            syncs = (step + 1) % unit == 0
            t += sync_s if syncs else step_s
            clock += sync_s if syncs else step_s
            record = {
                "kind": "step",
                "step": step,
                "t": t,
                "step_s": sync_s if syncs else step_s,
                "loss": 5.0,
                "sync": syncs,
            }
            if syncs:
                killed = kill is not None and outer == kill[1]
                if killed and group != 1:  # the survivors discard the outer step in flight and take it again
                    lines.append(
                        {
                            **record,
                            "outer": outer,
                            "committed": False,
                            "participants": 3,
                            "participating": True,
                            "healed": False,
                            "bytes": payload,
                            "rank": 16,
                        }
                    )
                    t += sync_s
                    record["t"] = t
                if kill is not None and group == 1 and outer in (kill[1], kill[1] + 1):
                    outer += 1
                    continue  # dead, then restarting
                healed = kill is not None and group == 1 and outer == kill[1] + 2
                record |= {
                    "outer": outer,
                    "committed": True,
                    "participants": hosts - ((group, outer) in skip),
                    "participating": (group, outer) not in skip,
                    "healed": healed,
                    "bytes": payload,
                    "wire": 2 * payload if wire is None else wire,
                    "rank": 16,
                }
                outer += 1
                evals.append({"kind": "eval", "step": step + 1, "clock": clock, "val_loss": loss_at(step + 1)})
            lines.append(record)
        lines.append({"kind": "final", "t": t, "steps": steps, "checksum": "same", "heals": 0, "tensors": 7})
        if group == 0:
            lines += evals
        (run_dir / f"group{group}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def run_result(tmp_path: Path, method: str, round_index: int, unit: int, **kwargs) -> dict:
    run_dir = tmp_path / f"{method}-{round_index}"
    write_run(run_dir, unit, **kwargs)
    kill = kwargs.get("kill")
    result = {
        "method": method,
        "round": round_index,
        "codes": [0, 0, 0],
        "wall_s": 60.0,
        "tx_bytes": [3000, 3000, 3000],
        "kill_t": kill[0] if kill else None,
    }
    return result | diloco_table.measure(run_dir, 3, kwargs.get("steps", 20), result["kill_t"])


def summary(tmp_path: Path, edgc_loss=0.0, edgc_sync=1.0, edgc_payload=1000) -> dict:
    """A slow link at which DiLoCo + EDGC syncs in ``edgc_sync`` s and uncompressed DiLoCo in 10 s."""
    results = []
    for round_index in (1, 2):
        results += [
            run_result(tmp_path, "ddp", round_index, 1, sync_s=8.0, payload=20000),
            run_result(tmp_path, "ddp-edgc", round_index, 1, sync_s=1.5, payload=1500),
            run_result(tmp_path, "diloco", round_index, 5, sync_s=10.0, payload=20000),
            run_result(
                tmp_path,
                "diloco-edgc",
                round_index,
                5,
                sync_s=edgc_sync,
                payload=edgc_payload,
                loss_at=lambda step: 8.0 - step / 10 + edgc_loss,
            ),
            run_result(
                tmp_path, "streaming-diloco-edgc", round_index, 5, sync_s=1.5 * edgc_sync, payload=edgc_payload // 2
            ),
        ]
    kill = run_result(tmp_path, "diloco-edgc", 9, 5, kill=(5.5, 1))
    return {
        "settings": BenchSettings(hosts=3, preset="tiny", micro_batch=1, steps=20, rounds=2).__dict__,
        "options": {"rates": [20.0], "sync_every": 5, "fragments": 2, "eval_every": 5, "time_budget_s": 150.0},
        "command": "edgc bench --diloco --steps 20",
        "date": "2026-11-25 03:00 UTC",
        "elapsed_s": 600.0,
        "load": [1.0, 1.0, 1.0],
        "links": [{"rate_mbit": 20.0, "results": results, "kill": kill}],
    }


SHAPES = [[1000, 960], [960]]  # 960,960 values: 3,843,840 bytes raw


def scaling_text(tmp_path: Path) -> str:
    """The scaling block of a synthetic run: torchft's ring, the one-stage quant3, the two-stage quant3-2s."""
    from edgc_bench.diloco_scaling import markdown

    return markdown(scaling_summary(tmp_path))


def scaling_summary(tmp_path: Path) -> dict:
    """A synthetic scaling run's summary (see `scaling_text`)."""
    rows, raw = [], 3_843_840
    for hosts in (3, 6, 12):
        ring = 2 * (hosts - 1) / hosts * raw
        for sync, wire in (("diloco", ring), ("quant3", 0.098 * 2 * (hosts - 1) * raw), ("quant3-2s", 0.098 * ring)):
            run_dir = tmp_path / f"{hosts}-{sync}"
            payload = raw if sync == "diloco" else int(0.098 * raw)
            write_run(run_dir, 5, hosts=hosts, payload=payload, wire=int(wire), shapes=SHAPES)
            rows.append({**diloco_table.measure(run_dir, hosts, 20, None), "hosts": hosts, "sync": sync})
    assert rows[0]["wire_bytes"] == int(2 * 2 / 3 * raw) and rows[0]["outer_step_s"] == pytest.approx(4 * 0.5 + 1.0)
    rows.append({**rows[0], "delay_ms": 15.0, "outer_step_s": 4.5})  # a run with latency added: its own table
    return {
        "rows": rows,
        "settings": BenchSettings(preset="tiny", steps=20).__dict__,
        "options": {"sync_every": 5},
        "command": "edgc bench --diloco --scaling 3,6,12",
        "rate_mbit": 20.0,
        "elapsed_s": 60.0,
        "date": "2026-11-27 10:00 UTC",
    }


def test_scaling_runs_of_other_host_counts_join_into_one_table_and_only_runs_alike_join(tmp_path):
    from edgc_bench.diloco_scaling import joined, markdown

    whole = scaling_summary(tmp_path)
    few = {**whole, "rows": [r for r in whole["rows"] if r["hosts"] != 12], "command": "a", "elapsed_s": 40.0}
    many = {**whole, "rows": [r for r in whole["rows"] if r["hosts"] == 12], "command": "b", "elapsed_s": 20.0}
    many["options"] = {**whole["options"], "scaling": [12]}
    both = joined([few, many])
    assert both["command"] == "a` and `b" and both["elapsed_s"] == 60.0
    assert markdown(both).replace("`a` and `b`", f"`{whole['command']}`") == markdown(whole)
    other = {**many, "settings": {**whole["settings"], "steps": 40}}
    with pytest.raises(ValueError, match="differ in settings steps"):
        joined([few, other])


def test_the_scaling_table_says_which_outer_sync_keeps_its_wire_flat_and_prices_what_users_compare_with(tmp_path):
    from edgc_bench.diloco_scaling import fp8_path_bytes

    # torchft's FP8 layout: rows padded to the groups, an fp32 scale and a byte a value, 4-aligned; a 1-D
    # tensor a row a value (8 bytes each)
    assert fp8_path_bytes(SHAPES, 3) == 1002 * (240 + 1) * 4 + 960 * 8
    text = scaling_text(tmp_path)
    assert "| 12 | 7.05 MB = 1.83× |" in text
    assert "- ✗ quant3: wire ÷ torchft's 0.294 · 0.588 · 1.176" in text
    assert (
        "- ✓ quant3-2s: wire ÷ torchft's 0.098 · 0.098 · 0.098 at 3, 6, 12 groups (≤ 0.12 at each), spread 0.0%" in text
    )
    share = [fp8_path_bytes(SHAPES, h) / 3_843_840 for h in (3, 6, 12)]
    assert (
        "- quant3-2s: wire ÷ a bf16 pseudo-gradient's ring all-reduce (priced) 0.196 · 0.196 · 0.196; ÷ torchft's "
        f"FP8 path (priced, its message {share[0]:.3f} · {share[1]:.3f} · {share[2]:.3f}× the fp32 one) "
        f"{0.098 / share[0]:.3f} · {0.098 / share[1]:.3f} · {0.098 / share[2]:.3f} at 3, 6, 12 groups" in text
    )
    assert "| 3 | 30 ms | 4.50 s (no delay 3.00 s) / – (no delay 3.00 s) / – (no delay 3.00 s) |" in text


def test_measures_from_the_logs(tmp_path):
    r = run_result(tmp_path, "diloco-edgc", 1, 5, skip={(2, 3)})
    assert r["outer_steps"] == 4 and r["steps_done"] == 20 and r["identical"] is True and r["tensors"] == 7
    assert r["participation"]["fraction"] == [1.0, 1.0, 0.75]
    assert r["floor_s"] == 0.5 and r["sync_step_s"] == 1.0 and r["payload_bytes"] == 1000
    assert r["evals"][-1] == (20, pytest.approx(12.0), pytest.approx(6.0)) and r["final_loss"] == pytest.approx(6.0)
    assert diloco_table.time_to(r, 7.0) == pytest.approx(6.0)  # the eval after 10 inner steps
    assert diloco_table.wire_per_sync(r) == 750


def test_a_kill_costs_the_outer_step_in_flight_and_the_killed_group_heals(tmp_path):
    r = run_result(tmp_path, "diloco-edgc", 1, 5, kill=(5.5, 1))  # in outer step 1's sync (5.0–6.0 s)
    assert r["discarded"] == 1 and not r["rolled_back"]
    assert r["stall_s"] == pytest.approx(1.5) and r["heal_s"] == pytest.approx(6.5)
    assert r["participation"]["fraction"] == [1.0, 0.5, 1.0] and r["participation"]["heals"] == [0, 1, 0]


def test_every_check_passes_when_diloco_edgc_wins(tmp_path):
    bench_md = diloco_table.markdown(summary(tmp_path))
    checks = [line for line in bench_md.splitlines() if line.startswith("- ")]
    assert checks and all(line.startswith("- ✓") for line in checks), checks
    assert "compute floor 0.50 s per inner step" in bench_md and "Gbit/s beside an H100" in bench_md
    assert "| DiLoCo + EDGC | 12.0 s | 12.0 s | 6.0000 | 4 | 0.001 MB |" in bench_md  # equal rounds: one value


def test_the_checks_fail_by_how_much(tmp_path):
    bench_md = diloco_table.markdown(summary(tmp_path, edgc_loss=0.1, edgc_sync=9.0, edgc_payload=5000))
    failed = [line for line in bench_md.splitlines() if line.startswith("- ✗")]
    assert any("loss at equal tokens" in line and "+1.67%" in line for line in failed), failed
    assert any("payload per outer step" in line and "= 0.250 (≤ 0.1)" in line for line in failed), failed
    assert any("wire per outer step" in line and "= 0.250 (≤ 0.12)" in line for line in failed), failed
    assert any("target 1.09 × sooner (≥ 2 ×)" in line for line in failed), failed


def test_the_table_goes_to_the_diloco_results_page(tmp_path, load_producer):
    script = load_producer("bench")
    table = script.section(diloco_table.markdown(summary(tmp_path)))
    assert script.block_markers(table) == (script.DILOCO_START, script.DILOCO_END)
    page = (ROOT / "docs/results/diloco.md").read_text()
    updated = script.update(page, table, script.DILOCO_START, script.DILOCO_END)
    block = updated.split(script.DILOCO_START)[1].split(script.DILOCO_END)[0]  # the six-host block stays beside it
    assert block.count("| DiLoCo + EDGC |") == 1 and "Kill pass at 20 Mbit/s" in block
    assert updated.count(script.DILOCO_MORE_START) == page.count(script.DILOCO_MORE_START) == 1


def test_the_committed_page_comes_from_a_run():
    """docs/results/diloco.md holds a bench's table as the script wrote it (a header line, the tables, checks)."""
    page = (ROOT / "docs/results/diloco.md").read_text()
    block = page.split("<!-- bench-diloco-table:start -->")[1].split("<!-- bench-diloco-table:end -->")[0]
    assert block.strip().startswith("`edgc bench --diloco") and "| DiLoCo + EDGC |" in block and "Kill pass" in block


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(hosts=2), "--hosts: --diloco needs ≥ 3"),
        (dict(rates="100,x"), "--rates: expected Mbit/s"),
        (dict(sync_every=7), "--sync-every: must be ≥ 2 and divide --steps = 60"),
        (dict(fragments=3), "--fragments: must be ≥ 2 and divide --sync-every = 10"),
        (dict(kill_at=5), r"--kill-at: with --diloco an outer step in \[1, outer steps - 2\] = \[1, 4\]"),
        (dict(torchft=True), "--diloco: runs plain data parallelism"),
        (dict(rate="100"), "--rate: --diloco runs at every rate of --rates"),
        (dict(time_budget=0.0), "--time-budget: must be > 0"),
        (dict(outer_sync="int7"), "--outer-sync: edgc or a registered sync method"),
        (dict(scaling_syncs="quant3,int7"), "--scaling-syncs: edgc or a registered sync method"),
        (dict(scaling="3,x"), "--scaling: expected host counts"),
        (dict(scaling="1,6"), "--scaling: every host count must be in 2..64"),
        (dict(delay_ms="0,x"), "--delay-ms: expected milliseconds"),
        (dict(delay_ms="-5"), "--delay-ms: every delay must be ≥ 0"),
        (dict(outer_sync="sparse64-mom"), "--outer-sync: .*modifier 'mom'"),
        (dict(methods="diloco,diloco-edgc@int7"), "--methods: edgc or a registered sync method"),
        (dict(methods="diloco,ddp@quant3"), "--methods: each of"),
    ],
)
def test_bad_flags_get_one_line(tmp_path, flags, message):
    settings = BenchSettings(hosts=flags.pop("hosts", 3), steps=60, preset="tiny")
    args = argparse.Namespace(
        **{
            "torchft": False,
            "link_only": False,
            "rate": None,
            "methods": None,
            "rates": "100,20",
            "sync_every": 10,
            "fragments": 2,
            "kill_at": None,
            "time_budget": 150.0,
            "edgc": [],
            "outer_sync": "quant3-2s",
            "scaling": None,
            "scaling_syncs": "quant3,quant3-2s",
            "delay_ms": "0",
            **flags,
        }
    )
    with pytest.raises(CLIError, match=message):
        diloco(settings, args, tmp_path)


def test_methods_choose_the_runs_and_an_outer_sync_each(tmp_path):
    from edgc_bench.diloco_bench import worker_args
    from edgc_bench.diloco_cli import diloco_options

    settings = BenchSettings(hosts=3, steps=60, preset="tiny")
    args = argparse.Namespace(
        rates="20",
        sync_every=10,
        fragments=2,
        kill_at=0,
        time_budget=150.0,
        edgc=[],
        outer_sync="sparse64-mom0",
        scaling=None,
        scaling_syncs="quant3,quant3-2s",
        delay_ms="0",
    )
    options = diloco_options(settings, argparse.Namespace(**vars(args), methods="diloco,diloco-edgc@quant3"))
    assert options.methods == ("diloco", "diloco-edgc@quant3") and options.kill_at is None
    sync = lambda method: (a := worker_args(settings, options, method, tmp_path))[a.index("--outer-sync") + 1]  # noqa: E731
    assert (sync("diloco-edgc@quant3"), sync("diloco-edgc")) == ("quant3", "sparse64-mom0")
    assert diloco_options(settings, argparse.Namespace(**vars(args), methods=None)).methods[0] == "ddp"


def test_streaming_fragments_hold_every_parameter_once():
    from edgc_bench.diloco_train import fragments_of
    from edgc_train.model import build_model, model_shape

    module = build_model(model_shape("tiny", 256, 16, n_layer=4, n_embd=32, n_head=2))
    for count in (2, 3, 4):
        fragments = fragments_of(module, count)
        held = [id(p) for f in fragments for p in f.parameters()]
        assert len(fragments) == count and sorted(held) == sorted(id(p) for p in module.parameters())
    sizes = [sum(p.numel() for p in f.parameters()) for f in fragments_of(module, 2)]
    assert max(sizes) < 2 * min(sizes)


def test_three_groups_train_diloco_edgc_through_a_lighthouse_on_loopback(tmp_path):
    """The worker end to end, small: 3 groups (torchft_quorum.launch_local_groups), 4 inner steps, an
    outer step every 2, on a tiny model, with DiLoCo's default outer sync (3-bit, through the manager)."""
    from edgc.integrations.torchft_quorum import QuorumSettings, launch_local_groups

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("In the beginning was the word, and the word was with the bench. " * 400)
    args = [
        "--out",
        str(tmp_path),
        "--method",
        "diloco-edgc",
        "--replicas",
        "3",
        "--steps",
        "4",
        "--sync-every",
        "2",
        "--eval-every",
        "2",
        "--preset",
        "tiny",
        "--n-layer",
        "1",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--seq-len",
        "16",
        "--vocab-size",
        "300",
        "--eval-batches",
        "1",
        "--data",
        str(corpus),
    ]
    code = launch_local_groups(
        "edgc_bench.diloco_train",
        3,
        QuorumSettings.for_groups(3, 0, timedelta(seconds=60)),
        lambda group: {"PYTHONPATH": str(ROOT / "src")},
        timeout_s=240,
        args=args,
        module=True,
    )
    assert code == 0, "a group failed (its output is above)"
    r = diloco_table.measure(tmp_path, 3, 4, None)
    assert r["steps_done"] == 4 and r["outer_steps"] == 2 and r["identical"] is True
    assert r["participation"]["fraction"] == [1.0, 1.0, 1.0] and r["discarded"] == 0
    assert [step for step, _, _ in r["evals"]] == [0, 2, 4] and r["payload_bytes"] > 0


def test_the_summaries_read_a_bench_table_as_diloco_table_writes_it(tmp_path, load_producer):
    """scripts/to_docs.py results-summary's README row and slow-links block, from a synthetic run's table."""
    script = load_producer("results-summary")
    bench = load_producer("bench")
    page = tmp_path / "root/docs/results/diloco.md"
    page.parent.mkdir(parents=True)
    page.write_text(
        bench.update("", bench.section(diloco_table.markdown(summary(tmp_path))), bench.DILOCO_START, bench.DILOCO_END)
    )
    guide = tmp_path / "root/docs/guides/slow-links.md"
    guide.parent.mkdir(parents=True)
    guide.write_text(scaling_text(tmp_path / "scaling"))
    row = script.diloco_row(tmp_path / "root")
    assert row == (
        "| DiLoCo (H = 5), 3 hosts at 20 Mbit/s, GPT-2 `tiny` | time to target 0.25× of torchft's DiLoCo | "
        "0.050× on the wire of torchft's fp32 DiLoCo (payload 0.050×); at 3 groups 0.20× a bf16 "
        "pseudo-gradient's, 0.39× torchft's FP8 path's (priced) | +0.00% | [diloco](docs/results/diloco.md) |"
    )
    block = script.diloco_summary(tmp_path / "root")
    edgc = next(line for line in block.splitlines() if line.startswith("| 20 Mbit/s | DiLoCo + EDGC |"))
    assert "| 12.0 s |" in edgc and "| 0.001 MB (0.050×) | 0.002 MB (0.050×) |" in edgc and "(+0.00%)" in edgc
    prose = " ".join(block.split())
    assert "Kill pass at 20 Mbit/s" in prose and "outer steps discarded 1, the survivors went on after 1.5 s" in prose


def test_the_slow_links_guide_holds_the_summary_of_the_committed_page(load_producer):
    script = load_producer("results-summary")
    guide = (ROOT / "docs/guides/slow-links.md").read_text()
    assert f"<!-- diloco-bench:start -->\n{script.diloco_summary()}\n<!-- diloco-bench:end -->" in guide
