"""`edgc bench --fsdp`: HSDP settings and the train flags each host runs (no network)."""

from pathlib import Path

import pytest

from edgc_bench.cli import settings_from
from edgc_bench.run import train_args
from edgc_cli.errors import CLIError
from edgc_cli.main import build_parser


def parse(*flags):
    return settings_from(build_parser(only="bench").parse_args(["bench", *flags]))


def test_fsdp_defaults_to_two_processes_per_host_and_none_vs_edgc():
    s = parse("--fsdp")
    assert (s.fsdp, s.hosts, s.nproc, s.methods) == (True, 2, 2, ("none", "edgc"))
    args = train_args(s, "edgc", Path("out"), None)
    assert args[args.index("--fsdp") + 1 : args.index("--fsdp") + 3] == ["--fsdp-shard", "2"]
    assert args[args.index("--ckpt-every") + 1] == "-1"  # a bench's runs write no checkpoints (GBs, never read)
    plain = parse()
    assert (plain.fsdp, plain.nproc) == (False, 1) and "--fsdp" not in train_args(plain, "none", Path("o"), None)


def test_fsdp_refuses_methods_the_fsdp_hook_cannot_run():
    with pytest.raises(CLIError, match="not available with --fsdp"):
        parse("--fsdp", "--methods", "none,topk")


def test_docs_sync_puts_an_hsdp_table_in_its_own_place(tmp_path, load_producer):
    module = load_producer("bench")
    page = tmp_path / "page.md"
    page.write_text("<!-- bench-table:start -->\nddp\n<!-- bench-table:end -->\n")
    bench = tmp_path / "bench.md"
    bench.write_text("<!-- bench:start -->\n2 hosts × 2 process(es) as HSDP (…)\n<!-- bench:end -->\n")
    assert module.main([str(bench), str(page)]) == 0
    text = page.read_text()
    assert "ddp" in text and "<!-- bench-hsdp-table:start -->\n2 hosts × 2 process(es) as HSDP (…)\n" in text
