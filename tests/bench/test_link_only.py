"""`edgc bench --link-only`: the link calibration alone (a few seconds), with the small sizes that
pin the per-collective latency. Needs root and iproute2; skipped with the reason otherwise."""

import json

import pytest

from edgc_bench.link_calibration import SIZES_MB, size_label, table
from edgc_bench.netns import NetnsError, check_prerequisites
from edgc_cli.main import main

try:
    check_prerequisites()
    REASON = None
except NetnsError as exc:
    REASON = str(exc)


def test_sizes_and_labels():
    assert SIZES_MB[0] == 4 / 1024 and max(SIZES_MB) == 64  # 4 KiB ... 64 MiB
    assert [size_label(mb) for mb in (4 / 1024, 0.25, 1, 64)] == ["4 KiB", "256 KiB", "1 MiB", "64 MiB"]
    rows = [{"mb": 4 / 1024, "seconds": 3e-4, "mean_s": 5e-4, "ideal_s": 3.3e-5, "ratio": 9.1, "effective_mbit": 109}]
    assert "| 4 KiB | 0.30 ms | 0.50 ms |" in table(rows, 1000)


@pytest.mark.skipif(REASON is not None, reason=f"netns emulation unavailable: {REASON}")
def test_link_only_writes_a_calibration_with_small_sizes(tmp_path, capsys):
    out = tmp_path / "link"
    assert main(["bench", "--link-only", "--out", str(out)]) == 0
    rows = json.loads((out / "calibration.json").read_text())
    assert [r["mb"] for r in rows] == list(SIZES_MB)
    assert all(r["seconds"] > 0 and r["mean_s"] > 0 for r in rows)
    assert rows[0]["burst_bytes"] == 250_000 and rows[0]["rate_mbit"] == 1000  # what the links were given
    assert rows[-1]["seconds"] > 10 * rows[0]["seconds"]  # 64 MiB takes far longer than 4 KiB
    assert "| 4 KiB |" in capsys.readouterr().out
    assert not (out / "runs").exists()  # nothing trained
    assert main(["bench", "--link-only", "--out", str(out)]) == 2  # never overwrites a calibration
    assert "already exists" in capsys.readouterr().err
