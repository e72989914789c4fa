"""The emulated hosts' switch with a delay on every path: latency between hosts where the kernel has no netem.

    ip netns exec BRIDGE python -m edgc_bench.delay_line --delay-ms 15 s0 s1 s2

`edgc_bench.netns.Network` starts it in its bridge namespace in place of the kernel bridge when
``delay_ms`` is set. Each port is the bridge end of one host's veth. A frame read from a port is
held ``delay_ms`` and written to the port of its destination's address (learned from the frames'
sources; an unknown, broadcast or multicast destination goes to every other port), so every path
between two hosts is that much longer each way: a round trip between two hosts is twice it. The
frames are read and written with their virtio-net header (``PACKET_VNET_HDR``), so the veths'
segmentation and checksum offloads pass through untouched; the ``tbf`` on each port then shapes
what its host receives as it did behind the bridge. One delay for all keeps the frames' order, so
one queue holds them. It prints ``ready`` once every port is open, and runs until it is killed;
it runs at nice -20, whatever the bench's nice: its timing is the latency being measured, and it
sleeps but for the frames it moves.
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
VNET_HDR_BYTES = 10  # struct virtio_net_hdr
FRAME_BYTES = 1 << 17  # a segmentation-offloaded frame is at most 64 KiB, with its headers


def open_port(name: str) -> socket.socket:
    """A raw socket on one port: every frame it receives (not those it sends), with its vnet header."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    sock.bind((name, ETH_P_ALL))
    sock.setblocking(False)
    return sock


class DelayLine:
    """Frames in, each out ``delay_s`` later on its destination's port (see the module docstring)."""

    def __init__(self, ports: list[str], delay_s: float):
        self.delay_s = delay_s
        self.sockets = {name: open_port(name) for name in ports}
        self.port_of_fd = {sock.fileno(): name for name, sock in self.sockets.items()}
        self.where: dict[bytes, str] = {}  # a source address -> the port it was seen on
        self.held: collections.deque = collections.deque()  # (due, in port, frame with its header)
        self.dropped = 0

    def read(self, port: str) -> None:
        sock = self.sockets[port]
        while True:
            try:
                data = sock.recv(FRAME_BYTES)
            except BlockingIOError:
                return
            frame = data[VNET_HDR_BYTES:]
            self.where[frame[6:12]] = port
            self.held.append((time.monotonic() + self.delay_s, port, data))

    def release(self) -> None:
        now = time.monotonic()
        while self.held and self.held[0][0] <= now:
            _, source, data = self.held.popleft()
            destination = data[VNET_HDR_BYTES : VNET_HDR_BYTES + 6]
            known = self.where.get(destination) if not destination[0] & 1 else None  # low bit: group address
            targets = [known] if known else [p for p in self.sockets if p != source]
            for port in targets:
                if port == source:
                    continue
                try:
                    self.sockets[port].send(data)
                except OSError:  # the port's queue is full: dropped, as a switch drops
                    self.dropped += 1

    def run(self) -> None:
        poller = select.epoll()
        for fd in self.port_of_fd:
            poller.register(fd, select.EPOLLIN)
        while True:
            timeout = max(0.0, self.held[0][0] - time.monotonic()) if self.held else 1.0
            for fd, _ in poller.poll(timeout):
                self.read(self.port_of_fd[fd])
            self.release()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("ports", nargs="+", help="the bridge ends of the hosts' veths")
    p.add_argument("--delay-ms", type=float, required=True, help="added to every frame, one way (≥ 0)")
    args = p.parse_args(argv)
    if args.delay_ms < 0:
        p.error(f"--delay-ms: must be ≥ 0, got {args.delay_ms:g}")
    os.setpriority(os.PRIO_PROCESS, 0, -20)
    line = DelayLine(args.ports, args.delay_ms / 1e3)
    print("ready", flush=True)
    line.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
