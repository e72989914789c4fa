"""`edgc bench --moe-experts E`: the settings, the train flags each host runs, and the table of each group's bytes
(no network)."""

from pathlib import Path

import pytest

from edgc_bench.cli import settings_from
from edgc_bench.run import train_args
from edgc_bench.table import groups_table, rows
from edgc_cli.errors import CLIError
from edgc_cli.main import build_parser


def parse(*flags):
    return settings_from(build_parser(only="bench").parse_args(["bench", *flags]))


def test_experts_split_over_a_hosts_processes_with_allreduce_against_edgc_by_default():
    s = parse("--moe-experts", "8")
    assert (s.moe_experts, s.hosts, s.nproc, s.methods) == (8, 2, 2, ("allreduce", "edgc"))
    args = train_args(s, "edgc", Path("out"), None)
    assert args[args.index("--moe-experts") + 1 : args.index("--moe-experts") + 4] == ["8", "--ep", "2"]
    assert "--moe-experts" not in train_args(parse(), "none", Path("o"), None)


@pytest.mark.parametrize(
    "flags, words",
    [
        (("--moe-experts", "8", "--methods", "none,edgc"), "not available with --moe-experts"),
        (("--moe-experts", "6", "--nproc", "4"), "multiple of --nproc 4"),
        (("--moe-experts", "8", "--fsdp"), "without --fsdp"),
    ],
)
def test_what_a_mixture_cannot_run_is_refused_in_one_line(flags, words):
    with pytest.raises(CLIError, match=words) as error:
        parse(*flags)
    assert "\n" not in str(error.value)


def run(sent: int, dense: int, expert: int) -> dict:
    line = {"rank": 4, "comm_time_s": 0.1, "step_time_s": 1.0, "compress_time_s": 0.0, "tokens_per_s": 100.0}
    line |= {"bytes_sent": sent, "dense_bytes_sent": dense, "expert_bytes_sent": expert, "wall_s": 10.0}
    line |= {"dense_bytes_raw": 4000, "expert_bytes_raw": 6000}
    return {"train": [line], "eval": [{"val_loss": 5.0, "val_ppl": 148.4, "wall_s": 10.0}]}


def test_each_groups_bytes_against_raw_and_the_ratios_to_our_uncompressed_sync():
    table = rows({"allreduce": run(10_000, 4000, 6000), "edgc": run(1500, 500, 1000)}, r_max=None)
    by = {r["method"]: r for r in table}
    assert by["edgc"]["bytes_per_step_x"] == 0.15  # no none: the reference is allreduce
    text = groups_table(table)
    assert "| edgc | 1.000 (1.00×) | 0.001 (0.125×) | 0.001 (0.167×) |" in text
    plain = run(1, 1, 1)
    plain["train"] = [{k: v for k, v in plain["train"][0].items() if not k.startswith(("dense_", "expert_"))}]
    assert groups_table(rows({"none": plain}, None)) == ""  # no mixture: no table


def test_docs_sync_puts_a_mixture_of_experts_table_in_its_own_place(tmp_path, load_producer):
    module = load_producer("bench")
    page = tmp_path / "page.md"
    page.write_text("<!-- bench-table:start -->\nddp\n<!-- bench-table:end -->\n")
    bench = tmp_path / "bench.md"
    line = "2 hosts × 2 process(es) with 8 experts per MLP split over a host's processes (EP 2), …"
    bench.write_text(f"<!-- bench:start -->\n{line}\n<!-- bench:end -->\n")
    assert module.main([str(bench), str(page)]) == 0
    assert "ddp" in page.read_text() and f"<!-- bench-moe-table:start -->\n{line}\n" in page.read_text()
