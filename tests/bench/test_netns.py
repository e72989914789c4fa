"""Fast check of the multi-host emulation: two namespaces, a 2-rank gloo all-reduce across them, clean-up.

Needs root and iproute2 (ip, tc); skipped with the reason otherwise.
"""

import os
import subprocess
import sys

import pytest

from edgc_bench.netns import NetnsError, Network, check_prerequisites, namespaces
from edgc_sim.tbf import burst_bytes

try:
    check_prerequisites()
    REASON = None
except NetnsError as exc:
    REASON = str(exc)

needs_netns = pytest.mark.skipif(REASON is not None, reason=f"netns emulation unavailable: {REASON}")

WORKER = """
import os, torch, torch.distributed as dist
from datetime import timedelta
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
t = torch.full((1000,), float(dist.get_rank() + 1))
dist.all_reduce(t)
assert t.eq(3.0).all(), t[:3]
print("ok", dist.get_rank(), os.environ["GLOO_SOCKET_IFNAME"], flush=True)
dist.destroy_process_group()
"""


def mine(prefix):
    return [n for n in namespaces() if n.startswith(prefix + "-")]


@needs_netns
def test_two_hosts_all_reduce_and_cleanup():
    net = Network(hosts=2, rate_mbit=1000, prefix=f"edgcb-test-{os.getpid()}")
    with net:
        assert sorted(mine(net.prefix)) == sorted([net.bridge, net.ns(0), net.ns(1)])
        qdisc = subprocess.run(
            ["ip", "netns", "exec", net.ns(0), "tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        ).stdout
        assert "tbf" in qdisc
        env = {"WORLD_SIZE": "2", "MASTER_ADDR": net.addr(0), "MASTER_PORT": "29511", "OMP_NUM_THREADS": "1"}
        procs = [
            net.popen(
                i,
                [sys.executable, "-c", WORKER],
                env={**env, "RANK": str(i)},
                timeout_s=60,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for i in range(2)
        ]
        codes = net.wait_all(procs)
        outputs = [p.stdout.read().decode() for p in procs]
        assert codes == [0, 0], outputs
        assert "ok 0 eth0" in outputs[0] and "ok 1 eth0" in outputs[1]
    assert mine(net.prefix) == []


ECHO = """
import socket, sys, time
if sys.argv[1] == "serve":
    server = socket.create_server(("0.0.0.0", 29512))
    peer, _ = server.accept()
    while data := peer.recv(64):
        peer.sendall(data)
else:
    for _ in range(100):
        try:
            peer = socket.create_connection((sys.argv[1], 29512))
            break
        except OSError:
            time.sleep(0.1)
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    trips = []
    for _ in range(5):
        start = time.perf_counter()
        peer.sendall(b"x")
        peer.recv(1)
        trips.append(time.perf_counter() - start)
    print(min(trips), flush=True)
"""


@needs_netns
def test_a_delay_holds_every_frame_each_way_and_goes_with_the_network():
    net = Network(hosts=2, rate_mbit=20, prefix=f"edgcb-test-{os.getpid()}-d", delay_ms=20)
    with net:
        line = net.processes[0]
        net.popen(0, [sys.executable, "-c", ECHO, "serve"], timeout_s=60)
        client = net.popen(1, [sys.executable, "-c", ECHO, net.addr(0)], timeout_s=60, stdout=subprocess.PIPE)
        out, _ = client.communicate(timeout=90)
        assert client.returncode == 0 and float(out) >= 2 * 0.020  # a round trip crosses the delay line twice
    assert line.poll() is not None and mine(net.prefix) == []
    with pytest.raises(ValueError, match="delay_ms"):
        Network(hosts=2, delay_ms=-1)


@needs_netns
def test_cleanup_after_an_exception_and_failed_setup():
    net = Network(hosts=2, rate_mbit=None, prefix=f"edgcb-test-{os.getpid()}-x")
    with pytest.raises(RuntimeError, match="boom"):
        with net:
            sleeper = net.popen(0, ["sleep", "60"])
            raise RuntimeError("boom")
    assert sleeper.poll() is not None  # the process started inside was stopped
    assert mine(net.prefix) == []
    # a name that already exists makes set-up fail half-way: what was created is removed again
    subprocess.run(["ip", "netns", "add", f"edgcb-test-{os.getpid()}-y-h1"], check=True)
    try:
        clash = Network(hosts=2, rate_mbit=1000, prefix=f"edgcb-test-{os.getpid()}-y")
        with pytest.raises(NetnsError, match="netns add"):
            clash.open()
        assert mine(clash.prefix) == [f"edgcb-test-{os.getpid()}-y-h1"]
    finally:
        subprocess.run(["ip", "netns", "del", f"edgcb-test-{os.getpid()}-y-h1"], check=False)


def test_burst_scales_with_rate():
    assert burst_bytes(1000) == 250_000
    assert burst_bytes(10) == 32 * 1024


def test_not_root_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsError, match="needs root"):
        check_prerequisites()
    from edgc_cli.main import main

    assert main(["bench", "--steps", "2"]) == 2


def test_docs_sync_copies_the_bench_section(tmp_path, load_producer):
    module = load_producer("bench")
    bench = tmp_path / "bench.md"
    bench.write_text("# x\n<!-- bench:start -->\n| a |\n<!-- bench:end -->\nrest\n")
    page = tmp_path / "page.md"
    page.write_text("intro\n")
    assert module.main([str(bench), str(page)]) == 0
    assert page.read_text() == "intro\n\n<!-- bench-table:start -->\n| a |\n<!-- bench-table:end -->\n"
    bench.write_text("<!-- bench:start -->\n| b |\n<!-- bench:end -->\n")
    module.main([str(bench), str(page)])
    assert "| b |" in page.read_text() and "| a |" not in page.read_text()


def test_docs_sync_puts_each_ddp_setting_in_its_own_block(tmp_path, load_producer):
    module = load_producer("bench")
    page = tmp_path / "page.md"
    page.write_text("intro\n")
    bench = tmp_path / "bench.md"
    for first_line, rows in (
        ("`edgc bench --out a` — 1000 Mbit/s per host link", "| one |"),
        ("`edgc bench --out b --r-max 8` — 1000 Mbit/s per host link", "| two |"),
        ("`edgc bench --out c --rate-mbit 100` — 100 Mbit/s per host link", "| three |"),
        (
            "`edgc bench --out d --rounds 2` — today, 2 rounds of none, edgc on 2 hosts, 1000 Mbit/s per host link",
            "| four |",
        ),
        (
            "`edgc bench --out e --rounds 2 --rate-mbit 100` — today, 2 rounds of none, edgc on "
            "2 hosts, 100 Mbit/s per host link",
            "| five |",
        ),
    ):
        bench.write_text(f"<!-- bench:start -->\n{first_line}\n{rows}\n<!-- bench:end -->\n")
        assert module.main([str(bench), str(page)]) == 0
    text = page.read_text()
    for marker, rows in (
        ("bench-table", "| one |"),
        ("bench-rmax-table", "| two |"),
        ("bench-slow-link-table", "| three |"),
        ("bench-rounds-table", "| four |"),
        ("bench-slow-link-rounds-table", "| five |"),
    ):
        assert text.split(f"<!-- {marker}:start -->")[1].split(f"<!-- {marker}:end -->")[0].endswith(f"{rows}\n")
