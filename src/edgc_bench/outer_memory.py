"""What one DiLoCo outer step allocates beyond what the process already held, per parameter.

    python -m edgc_bench.outer_memory --out docs/results/outer_memory.json   # 2^23 and 2^25, ~5 min

Two processes on 127.0.0.1 run `edgc.integrations.diloco.DiLoCo` (a plain gloo process group) or
`edgc.integrations.torchft.DiLoCo` (two torchft replica groups around an in-process lighthouse), an
outer step every inner step (plain SGD inner steps on fixed gradients: no allocation of their own),
on a model of 2^k float32 parameters in tensors of 2^20. Two outer steps warm up (the error
feedback, the owners' error feedback and the outer momentum are made there and held after); the
third is measured two ways, each rank:

- ``rss``: the peak resident set during the step (``VmHWM`` after ``/proc/self/clear_refs`` reset it)
  minus the resident set before it, with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``) so
  that freed tensors go back to the kernel instead of being held for reuse: what the CPU path takes;
- ``live``: the most bytes of tensors made during the step alive at once (`edgc_probes.live_memory`,
  counted as the engine's memory is): what a caching allocator would hold on an accelerator.

Methods (``--methods``): registered sync methods by name (``quant3``, today's one-stage default;
``quant3-2s``, the two-stage one; ``bf16``, a cast for reference), each on ``plain`` and ``torchft``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from edgc_probes.live_memory import LiveStorages

TENSOR = 2**20  # values per parameter tensor
MMAP_THRESHOLD = str(128 * 1024)  # bytes: every tensor's block is mmapped, and unmapped when freed


def _proc_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _model(log2: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(TENSOR)) for _ in range(2 ** (log2 - 20))])
    for p in model:
        p.grad = torch.randn_like(p) * 1e-3  # fixed: the inner steps allocate nothing
    return model


def _manager(rank: int, lighthouse: str, module, inner):
    from torchft import Manager, ProcessGroupGloo

    from edgc.integrations.torchft_quorum import QuorumSettings

    quorum = QuorumSettings.for_groups(2, 0, timedelta(seconds=120))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=quorum.timeout),
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        replica_id=f"group{rank}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        use_async_quorum=False,
        init_sync=False,
        **quorum.manager_kwargs(),
    )
    return manager, store


def _diloco(rank: int, path: str, method: str, module, inner, outer, connect: str):
    if path == "plain":
        from edgc.integrations.diloco import DiLoCo

        dist.init_process_group("gloo", init_method=connect, rank=rank, world_size=2, timeout=timedelta(seconds=120))
        return DiLoCo(None, [module], inner, outer, 1, sync_method=method), None
    from edgc.integrations.torchft import DiLoCo

    manager, store = _manager(rank, connect, module, inner)
    return DiLoCo(manager, [module], inner, outer, 1, sync_method=method), (manager, store)


def step_memory(diloco, inner) -> tuple[int, int, bool]:
    """(resident bytes, live tensor bytes, committed) of one outer step after two warm ones, each the
    most beyond what was held before it (an outer step every inner step: ``sync_every`` 1)."""
    with diloco:
        for _ in range(2):
            inner.step()  # warm: error feedback, the owners' and the outer momentum are made
        before = _proc_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident set starts again from now
        inner.step()
        rss = _proc_kib("VmHWM") - before
        with LiveStorages() as live:
            inner.step()
        return 1024 * rss, live.peak_bytes, diloco.last_outer_step["committed"]


def measure_rank(rank: int, path: str, method: str, log2: int, connect: str, out) -> None:
    """One rank's figures of one method (see the module docstring), put on ``out``."""
    torch.set_num_threads(1)
    module = _model(log2)
    inner = torch.optim.SGD(module.parameters(), lr=1e-3)
    outer = torch.optim.SGD(module.parameters(), lr=0.7, momentum=0.5, nesterov=True)
    diloco, torchft = _diloco(rank, path, method, module, inner, outer, connect)
    rss, live, committed = step_memory(diloco, inner)
    params = sum(p.numel() for p in module.parameters())
    out.put({"rank": rank, "rss_bytes": rss, "live_bytes": live, "params": params, "ok": committed})
    if torchft is not None:
        torchft[0].shutdown(wait=False)
    elif dist.is_initialized():
        dist.destroy_process_group()


def run_case(path: str, method: str, log2: int) -> dict:
    """Both ranks of one case in new processes: their figures in bytes per parameter."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # read by glibc when the child starts
    lighthouse = None
    if path == "torchft":
        from torchft._torchft import LighthouseServer

        from edgc.integrations.torchft_quorum import QuorumSettings

        lighthouse = LighthouseServer(
            bind="[::]:0", **QuorumSettings.for_groups(2, 0, timedelta(seconds=120)).lighthouse_kwargs()
        )
        connect = lighthouse.address()
    else:
        connect = f"tcp://127.0.0.1:{_free_port()}"
    context = mp.get_context("spawn")
    out = context.Queue()
    ranks = [context.Process(target=measure_rank, args=(r, path, method, log2, connect, out)) for r in range(2)]
    for process in ranks:
        process.start()
    results = [out.get(timeout=600) for _ in ranks]
    for process in ranks:
        process.join(timeout=60)
    if lighthouse is not None:
        lighthouse.shutdown()
    params = results[0]["params"]
    return {
        "path": path,
        "method": method,
        "params": params,
        "committed": all(r["ok"] for r in results),
        "rss_bytes_per_param": max(r["rss_bytes"] for r in results) / params,
        "live_bytes_per_param": max(r["live_bytes"] for r in results) / params,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--log2-params", default="23,25", help="model sizes, as powers of two (default 23,25)")
    p.add_argument("--methods", default="quant3-2s,quant3,bf16", help="registered sync methods")
    p.add_argument("--paths", default="plain,torchft", help="plain (a gloo process group) and/or torchft")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    rows, started = [], time.time()
    for log2 in (int(v) for v in args.log2_params.split(",")):
        if not 20 <= log2 <= 30:
            p.error(f"--log2-params: each in 20..30, got {log2}")
        for path in args.paths.split(","):
            for method in args.methods.split(","):
                row = run_case(path, method, log2)
                rows.append(row)
                print(
                    f"2^{log2} {path:8s} {method:10s} rss {row['rss_bytes_per_param']:6.2f} B/param, "
                    f"live {row['live_bytes_per_param']:6.2f} B/param, committed {row['committed']}",
                    flush=True,
                )
    result = {
        "command": "python -m edgc_bench.outer_memory " + " ".join(sys.argv[1:] if argv is None else argv),
        "rows": rows,
        "elapsed_s": round(time.time() - started),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
