"""`edgc bench --torchtitan` without a network: the command line each method's torchtitan run gets, the figures
read from its records, and the table's way into the manual (its own block)."""

from pathlib import Path

from edgc_bench.run import BenchSettings
from edgc_bench.torchtitan_bench import TitanOptions, checks, edgc_flags, markdown, summary_row, titan_args


def test_the_benchs_edgc_items_become_torchtitans_flags():
    items = {"profile_max_rank": 8, "warmup_error_test": False, "adaptive": True, "rank_schedule": [[0, 2], [5, 4]]}
    assert edgc_flags(items) == [
        "--edgc.profile_max_rank",
        "8",
        "--edgc.no-warmup-error-test",
        "--edgc.adaptive",
        "--edgc.rank_schedule",
        "0",
        "2",
        "5",
        "4",
    ]


def test_native_is_torchtitans_own_config_and_only_edgc_gets_its_flags(tmp_path):
    settings = BenchSettings(hosts=2, nproc=2, steps=8, r_max=4)
    native, edgc = (titan_args(settings, TitanOptions(), m, tmp_path / m, tmp_path) for m in ("native", "edgc"))
    assert native[:4] == ["--module", "torchtitan.models.llama3", "--config", "llama3_debugmodel"]
    assert edgc[:4] == ["--module", "edgc.integrations.torchtitan", "--config", "llama3_debugmodel"]
    assert not any(a.startswith("--edgc.") for a in native)
    assert edgc[edgc.index("--edgc.r_max") + 1] == "4"
    for args in (native, edgc):
        assert args[args.index("--parallelism.data_parallel_replicate_degree") + 1] == "2"
        assert args[-1] == "activation-checkpoint:none"  # a subcommand is last


def _step(method: str, i: int, seconds: float, sent: int) -> dict:
    edgc = {"bytes_sent": sent, "rank": 4, "phase": "warmup" if i < 2 else "compress"} if method == "edgc" else {}
    by_mesh = {"fsdp": edgc, "efsdp": {**edgc, "bytes_sent": sent // 2}} if edgc else {}
    return {"step": i + 1, "seconds": seconds, "loss": 8.0 - i, "grad_norm": 1.0, "edgc": edgc, "edgc_by_mesh": by_mesh}


def _run(method: str, seconds: list[float], sent: list[int], codes=(0, 0)) -> dict:
    steps = [_step(method, i, s, b) for i, (s, b) in enumerate(zip(seconds, sent))]
    record = {"steps": steps, "shard_bytes": 1000, "digest": {"w": "a"}}
    return {"method": method, "codes": list(codes), "tx_bytes": [4000, 4000], "records": [record, record]}


def test_the_figures_are_the_second_halfs_and_a_failed_run_says_so():
    native = summary_row(_run("native", [9, 9, 2, 4], [0] * 4), 4)
    assert native["step_s"] == 3 and native["step_s_range"] == [2, 4] and native["payload_per_step"] == 1000
    edgc = summary_row(_run("edgc", [9, 9, 1, 1], [1000, 1000, 30, 50]), 4)
    assert edgc["payload_by_mesh"] == {"fsdp": 40, "efsdp": 20} and edgc["payload_per_step"] == 60
    assert edgc["ranks"] == [4] and edgc["wire_per_step"] == 1000
    failed = summary_row(_run("edgc", [1], [1], codes=(0, 1)), 4)
    summary = {
        "settings": {"hosts": 2, "nproc": 2, "steps": 4, "micro_batch": 2, "seq_len": 128, "rate_mbit": 1000.0}
        | {"config": "deepseek_v3_debugmodel", "ep": 2},
        "command": "edgc bench --torchtitan",
        "torchtitan": "0.3.0",
        "date": "today",
        "load_start": (1.0, 1.0, 1.0),
        "load_end": (2.0, 2.0, 2.0),
        "rows": [native, failed],
    }
    text = markdown(summary)
    assert text.startswith("`edgc bench --torchtitan`: torchtitan 0.3.0 deepseek_v3_debugmodel, HSDP 2 replicas")
    assert ", EP 2," in text.splitlines()[0] and "failed (exit codes [0, 1])" in text
    summary["rows"] = [native, edgc]
    summary["checks"] = [["a check", True], ["another", False]]
    text = markdown(summary)
    assert "| edgc | 1.00 [1.00–1.00] | 0.33× |" in text and "| 0.000 (dense 0.000 + experts 0.000) |" in text
    assert "- a check: holds" in text and "- another: fails" in text


def test_the_checks_compare_the_warmup_with_native_and_the_replicas():
    native, edgc = _run("native", [1] * 4, [0] * 4)["records"], _run("edgc", [1] * 4, [9] * 4)["records"]
    edgc[0]["edgc_parameters"] = {"fsdp": ["norm.weight"], "efsdp": ["layers.1.moe.routed_experts.w1"]}
    assert [holds for _, holds in checks({"native": native, "edgc": edgc}, nproc=1, ep=2)] == [True, True, True]
    edgc[1] = {**edgc[1], "digest": {"w": "b"}}
    edgc[0]["edgc_parameters"]["fsdp"].append("layers.1.moe.routed_experts.w2")
    assert [holds for _, holds in checks({"native": native, "edgc": edgc}, nproc=1, ep=2)] == [True, False, False]


def test_its_table_has_a_block_of_its_own(tmp_path: Path, load_producer):
    module = load_producer("bench")
    bench = tmp_path / "bench.md"
    bench.write_text("<!-- bench:start -->\n`edgc bench --torchtitan --out x`: torchtitan\n| t |\n<!-- bench:end -->\n")
    page = tmp_path / "page.md"
    page.write_text("intro\n")
    assert module.main([str(bench), str(page)]) == 0
    assert "<!-- bench-torchtitan-table:start -->" in page.read_text()
    moe = "`edgc bench --torchtitan m --torchtitan-ep 2`: t\n| e |\n"
    bench.write_text(f"<!-- bench:start -->\n{moe}<!-- bench:end -->\n")
    assert module.main([str(bench), str(page)]) == 0
    assert "<!-- bench-torchtitan-moe-table:start -->\n`edgc bench --torchtitan m" in page.read_text()
