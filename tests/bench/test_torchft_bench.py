"""`edgc bench --torchft` without a network: its table and checks on synthetic runs, the results page
routing of its table, the measures taken from the workers' step logs, and its flag checks."""

import argparse
import json

import pytest

from edgc_bench import torchft_bench, torchft_table
from edgc_bench.cli import torchft
from edgc_bench.run import BenchSettings
from edgc_cli.errors import CLIError
from edgc_probes.participation import participation


def every_group_every_step(groups=2, steps=40):
    return {"per_step": [groups] * steps, "fraction": [1.0] * groups, "heals": [0] * groups, "alone": []}


def summary(ft_edgc_step=0.6, ft_wall=80.0, elastic_wall=120.0, loss=4.02, lost=1):
    def result(step_s, wall_s, steps_lost, heal_s, val_loss, identical):
        return {
            "step_s": step_s,
            "wall_s": wall_s,
            "steps_lost": steps_lost,
            "heal_s": heal_s,
            "val_loss": val_loss,
            "identical": identical,
            **({"participation": every_group_every_step()} if identical is not None else {}),
        }

    return {
        "settings": BenchSettings().__dict__,
        "command": "edgc bench --torchft",
        "kill_at": 20,
        "ckpt_every": 10,
        "date": "2026-11-23 13:00 UTC",
        "load": (1.0, 1.0, 1.0),
        "results": {
            "ddp-edgc": result(0.58, 60.0, 0, None, 3.9, None),
            "torchft-nofail": result(1.0, 90.0, 0, None, 4.2, True),
            "torchft-edgc-nofail": result(ft_edgc_step, 61.0, 0, None, 4.0, True),
            "torchft": result(1.0, 100.0, 9, 8.0, 4.3, True),
            "torchft-edgc": result(ft_edgc_step, ft_wall, lost, 8.0, loss, True),
            "elastic-edgc": result(0.6, elastic_wall, 11, 30.0, 4.0, None),
        },
    }


def test_checks_pass_and_fail_on_their_thresholds():
    good = torchft_table.checks(summary())
    assert len(good) == 9 and all(line.startswith("- ✓") for line in good), good
    bad = torchft_table.checks(summary(ft_edgc_step=0.7, ft_wall=130.0, loss=4.1, lost=3))
    failed = [line for line in bad if line.startswith("- ✗")]
    assert len(failed) == 5, bad  # ratio to torchft (0.70), to plain DDP (+21 %), steps lost, wall, loss
    assert "0.70" in failed[0] and "+2.50%" in failed[-1]


def test_groups_left_out_of_quorums_fail_the_participation_check_and_differing_replicas_are_loud():
    s = summary()
    # Three groups, two in every quorum in turn, the last step in a quorum of one (as seen with a 1 s
    # join timeout and min_replicas 1).
    s["results"]["torchft-edgc-nofail"] |= {
        "identical": False,
        "participation": {
            "per_step": [2] * 39 + [1],
            "fraction": [0.675, 0.65, 0.675],
            "heals": [13, 14, 13],
            "alone": [39],
        },
    }
    failed = [line for line in torchft_table.checks(s) if line.startswith("- ✗")]
    assert len(failed) == 1 and "lowest 65%" in failed[0] and "bit-identical at the end (NO)" in failed[0], failed
    bench_md = torchft_table.markdown(s)
    assert "**⚠ REPLICAS DIFFER: torchft + EDGC, no failure ended with different parameters" in bench_md
    assert bench_md.index("REPLICAS DIFFER") < bench_md.index("| run |")  # above the tables
    assert "| torchft + EDGC, no failure | 2 ×39, 1 | 68% · 65% · 68% | 13 · 14 · 13 | 1 |" in bench_md
    assert "REPLICAS DIFFER" not in torchft_table.markdown(summary())


def test_the_table_goes_to_the_torchft_results_page(load_producer):
    bench_md = torchft_table.markdown(summary())
    script = load_producer("bench")
    page = (
        "# x\n\n<!-- bench-torchft-table:start -->\nold\n<!-- bench-torchft-table:end -->\n\n"
        "<!-- bench-table:start -->\n"
    )
    table = script.section(bench_md)
    assert (
        "(one replica group each)" in table
        and "| torchft + EDGC | 0.600 s | 80.0 s | 1 | 8.0 s | 4.0200 | yes |" in table
    )
    updated = script.update(page, table, script.TORCHFT_START, script.TORCHFT_END)
    assert "old" not in updated and updated.count("| torchft + EDGC | 0.600 s |") == 1


def test_steps_lost_and_heal_time_from_the_step_logs(tmp_path, monkeypatch):
    """A torchft run read back: the survivor's uncommitted step is the one step lost."""
    lines = {
        0: [{"kind": "start", "pid": 1, "t": 0.0, "restart": 0}]
        + [
            {"kind": "step", "step": s, "t": 1.0 + s, "step_s": 0.5, "committed": True, "participants": 2}
            for s in range(5)
        ]
        + [{"kind": "step", "step": 5, "t": 6.5, "step_s": 0.5, "committed": False, "participants": 2}]
        + [
            {
                "kind": "step",
                "step": s,
                "t": 2.0 + s,
                "step_s": 0.1 if s < 8 else 0.5,
                "committed": True,
                "participants": 1 if s < 8 else 2,
            }
            for s in range(5, 10)
        ]
        + [{"kind": "final", "t": 13.0, "val_loss": 4.0, "checksum": "a"}],
        1: [{"kind": "start", "pid": 2, "t": 0.0, "restart": 0}]
        + [
            {"kind": "step", "step": s, "t": 1.0 + s, "step_s": 0.5, "committed": True, "participants": 2}
            for s in range(5)
        ]
        + [{"kind": "start", "pid": 3, "t": 7.0, "restart": 1}]
        + [
            {
                "kind": "step",
                "step": s,
                "t": 2.0 + s,
                "step_s": 0.5,
                "committed": True,
                "participants": 2,
                "healed": s == 8,
            }
            for s in range(8, 10)
        ]
        + [{"kind": "final", "t": 13.0, "val_loss": 4.0, "checksum": "a"}],
    }
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for group, records in lines.items():
        (run_dir / f"group{group}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    measures = torchft_bench.measure_torchft(run_dir, hosts=2, steps=10, kill_t=6.0)
    assert measures["steps_lost"] == 1 and measures["identical"] is True
    assert measures["heal_s"] == pytest.approx(4.0)  # kill at t=6, the restarted group's first step at t=10
    assert measures["step_s"] == 0.5  # only steps with both groups in the quorum
    # Steps 5–7: group 0 alone; group 1, restarted, healed into step 8 and took part from there.
    assert measures["participation"] == {
        "per_step": [2] * 5 + [1] * 3 + [2] * 2,
        "fraction": [1.0, 0.7],
        "heals": [0, 1],
        "alone": [5, 6, 7],
    }


def test_a_group_that_commits_a_step_behind_its_peers_did_not_take_part_in_it():
    """Groups 0 and 1 commit steps 0–2 together; group 2 commits step 0 with them, then steps 1–2 alone."""

    def line(step, participants):
        return {"kind": "step", "step": step, "committed": True, "participants": participants}

    together = [line(s, 3 if s == 0 else 2) for s in range(3)]
    measured = participation([together, together, [line(0, 3), line(1, 1), line(2, 1)]], steps=4)
    assert measured["per_step"] == [3, 2, 2, 0] and measured["fraction"] == [0.75, 0.75, 0.25]
    assert measured["alone"] == [1, 2] and measured["heals"] == [0, 0, 0]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hosts=1), "needs ≥ 2 hosts"),
        (dict(kill_at=39), "--kill-at"),
        (dict(ckpt_every=0), "--ckpt-every"),
        (dict(tp=2, nproc=2), "drop --tp/--pp/--fsdp"),
    ],
)
def test_bad_flags_get_one_line(tmp_path, change, message):
    settings = BenchSettings(steps=40, **{k: v for k, v in change.items() if k in ("hosts", "tp", "nproc")})
    args = argparse.Namespace(kill_at=change.get("kill_at"), ckpt_every=change.get("ckpt_every", 10))
    with pytest.raises(CLIError, match=message.replace("|", r"\|")):
        torchft(settings, args, tmp_path)
