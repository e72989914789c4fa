"""Emulated hosts: one network namespace per host, a bridge namespace, rate-limited veth links.

    with Network(hosts=2, rate_mbit=1000) as net:
        net.popen(0, ["python", "-c", "..."], env={...})   # runs inside host 0's namespace
    # every namespace (and every process started through `popen`) is gone here

Topology (all names carry a per-invocation prefix, ``edgcb-<pid>-…``, so parallel runs never meet)::

    host i: namespace <prefix>-h<i>, interface eth0, address 10.213.0.<i+1>/24
       └── veth ── s<i> ── br0 (bridge) in namespace <prefix>-br

``tc tbf`` limits both ends of every host link (eth0: what the host sends; s<i>: what it receives),
so each host has its own full-duplex NIC of ``rate_mbit``. netem is not in this kernel: with
``delay_ms`` a userspace switch (`edgc_bench.delay_line`) takes br0's place in the bridge namespace
and holds every frame that long, so a round trip between two hosts takes twice it; no loss is
added. Addresses exist only inside the namespaces created here.

Clean-up is guaranteed on every exit path: the context manager's ``__exit__`` (normal end, any
exception, Ctrl-C = KeyboardInterrupt), SIGTERM/SIGHUP (turned into SystemExit while the network
exists) and ``atexit`` as a last resort. It first kills the process groups started by ``popen``, then
deletes the namespaces (deleting a namespace deletes its veth ends and qdiscs).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from edgc_sim.tbf import burst_bytes

SUBNET = "10.213.0"
HOST_IF = "eth0"


class NetnsError(RuntimeError):
    """The emulation cannot run here (not root, no ip/tc) or a set-up command failed."""


def check_prerequisites() -> None:
    """Raise NetnsError with one clear line unless namespaces and tc can be used; changes nothing."""
    if os.geteuid() != 0:
        raise NetnsError("network emulation needs root (it creates network namespaces); run as root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(f"network emulation needs {' and '.join(missing)} (package iproute2), not found on PATH")


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


class Network:
    def __init__(self, hosts: int, rate_mbit: float | None = 1000.0, prefix: str | None = None, delay_ms: float = 0.0):
        if hosts < 1 or hosts > 250:
            raise ValueError(f"hosts: must be in [1, 250], got {hosts}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit: must be > 0, got {rate_mbit}")
        if delay_ms < 0:
            raise ValueError(f"delay_ms: must be ≥ 0, got {delay_ms}")
        self.hosts = hosts
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        self.prefix = prefix or f"edgcb-{os.getpid()}"
        self.bridge = f"{self.prefix}-br"
        self.created: list[str] = []
        self.processes: list[subprocess.Popen] = []
        self._old_handlers: dict[int, object] = {}
        self._closed = True

    # ------------------------------------------------------------------ names
    def ns(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    @staticmethod
    def addr(host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    ifname = HOST_IF

    # ------------------------------------------------------------------ set-up
    def _ip(self, *args: str) -> None:
        result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NetnsError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")

    def _tc(self, ns: str, dev: str) -> None:
        cmd = [
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{self.rate_mbit}mbit",
            "burst",
            str(burst_bytes(self.rate_mbit)),
            "latency",
            "50ms",
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NetnsError(f"`{' '.join(cmd)}` failed: {result.stderr.strip()}")

    def _add_ns(self, name: str) -> None:
        self._ip("netns", "add", name)
        self.created.append(name)
        self._ip("-n", name, "link", "set", "lo", "up")

    def open(self) -> Network:
        check_prerequisites()
        self._closed = False
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, _raise_exit)
        try:
            self._add_ns(self.bridge)
            if not self.delay_ms:
                self._ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
                self._ip("-n", self.bridge, "link", "set", "br0", "up")
            for i in range(self.hosts):
                ns, port = self.ns(i), f"s{i}"
                self._add_ns(ns)
                self._ip("-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", HOST_IF, "netns", ns)
                if self.delay_ms:
                    self._ip("-n", self.bridge, "link", "set", port, "promisc", "on")
                else:
                    self._ip("-n", self.bridge, "link", "set", port, "master", "br0")
                self._ip("-n", self.bridge, "link", "set", port, "up")
                self._ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", HOST_IF)
                self._ip("-n", ns, "link", "set", HOST_IF, "up")
                if self.rate_mbit is not None:
                    self._tc(ns, HOST_IF)
                    self._tc(self.bridge, port)
            if self.delay_ms:
                self._start_delay_line()
        except BaseException:
            self.close()
            raise
        return self

    __enter__ = open

    def _start_delay_line(self) -> None:
        """The switch that delays every frame (`edgc_bench.delay_line`), in the bridge namespace."""
        source = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}
        ports = [f"s{i}" for i in range(self.hosts)]
        argv = [sys.executable, "-m", "edgc_bench.delay_line", "--delay-ms", f"{self.delay_ms:g}", *ports]
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.bridge, *argv],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.processes.append(process)
        if process.stdout.readline().strip() != "ready":
            raise NetnsError(f"the delay line did not start (exit {process.poll()}): `{' '.join(argv)}`")

    # ------------------------------------------------------------------ processes
    def command(
        self, host: int, argv: list[str], env: dict[str, str] | None = None, timeout_s: float | None = None
    ) -> list[str]:
        """argv run inside host ``host``'s namespace (with GLOO_SOCKET_IFNAME and ``env``), under timeout."""
        variables = {"GLOO_SOCKET_IFNAME": HOST_IF, **(env or {})}
        cmd = ["ip", "netns", "exec", self.ns(host), "env", *[f"{k}={v}" for k, v in variables.items()], *argv]
        if timeout_s is not None:
            cmd = ["timeout", "--kill-after=10", str(int(timeout_s)), *cmd]
        return cmd

    def popen(
        self, host: int, argv: list[str], env: dict[str, str] | None = None, timeout_s: float | None = None, **kwargs
    ) -> subprocess.Popen:
        """Start argv in host ``host``'s namespace, in its own process group (killed on close)."""
        process = subprocess.Popen(self.command(host, argv, env, timeout_s), start_new_session=True, **kwargs)
        self.processes.append(process)
        return process

    def wait_all(self, processes: list[subprocess.Popen]) -> list[int]:
        """Wait for all; if one fails, give the others 30 s, then stop them (a dead peer hangs gloo)."""
        codes: dict[int, int] = {}
        deadline = None
        while len(codes) < len(processes):
            for i, p in enumerate(processes):
                if i not in codes and p.poll() is not None:
                    codes[i] = p.returncode
                    if p.returncode != 0 and deadline is None:
                        deadline = time.monotonic() + 30
            if deadline is not None and time.monotonic() > deadline:
                for i, p in enumerate(processes):
                    if i not in codes:
                        _kill_group(p)
            time.sleep(0.2)
        return [codes[i] for i in range(len(processes))]

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in self.processes:
            _kill_group(p)
        for p in self.processes:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self.created.clear()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old_handlers.clear()
        atexit.unregister(self.close)

    def __exit__(self, *exc) -> None:
        self.close()


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _kill_group(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
