"""One replica group's worker for `edgc bench --diloco` (run by torchrun inside a host's namespace).

The training is edgc train's (GPT-2 preset, data, sampler, AdamW, lr schedule per inner step,
clipping, validation blocks); every method is a torchft replica group, one per host, with a
lighthouse on host 0 and `QuorumSettings.for_groups` (torchft_bench.py). ``--method``:

* ``ddp``: torchft's own DistributedDataParallel, uncompressed, a sync every step;
* ``ddp-edgc``: `edgc.integrations.torchft.DistributedDataParallel`, EDGC every step;
* ``diloco``: torchft's own ``torchft.local_sgd.DiLoCo`` with ``should_quantize=False``: its plain
  all-reduce of the pseudo-gradients (its FP8 path needs Triton and a GPU);
* ``diloco-edgc``: `edgc.integrations.torchft.DiLoCo`, EDGC on the pseudo-gradients.

The DiLoCo methods take ``--sync-every`` H inner steps per outer step (outer: Nesterov SGD, lr 0.7,
momentum 0.9 as in the DiLoCo paper); with ``--fragments`` F > 1 they are Streaming DiLoCo: the
model is cut into F contiguous fragments of similar size, one syncs every H / F inner steps.

Each process writes ``<out>/group<G>.jsonl``: a ``start`` line, a ``model`` line (the parameters'
shapes, what prices a sync from its byte layout), one ``step`` line per inner step
(step time, training loss; on a sync step the outer step, committed or not, the quorum's
participants, whether this group was one, whether it healed, the payload bytes, the bytes the process
wrote to its sockets in the sync step (`socket_writes`) and EDGC's rank), a
``sync_start`` line just before a sync step's sync (the bench kills a group there), and a ``final``
line (validation loss and a digest of the shared model: θ_global for DiLoCo, the parameters for DDP).
Group 0 also keeps the shared model every ``--eval-every`` inner steps with its training clock and,
after the run, writes one ``eval`` line per copy (validation loss at that step and time).

The bench stops a run that overruns its time budget by writing ``<out>/stop.json`` (``{"steps": S}``,
S a step every group reaches later, at a sync): each group reads it before every inner step.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch

from edgc import EDGCConfig
from edgc.integrations import torchft_adapter
from edgc.sync.sync_methods import outer_sync_spec
from edgc_train.data import prepare_data
from edgc_train.model import build_model, model_shape
from edgc_train.sampler import BlockSampler
from edgc_train.train import lr_lambda, make_optimizer, seed_everything

from .torchft_train import (
    add_worker_flags,
    batch,
    forward_backward,
    parameter_digest,
    replica_manager,
    sync_step,
    torchft_sync,
    train_config,
    validation_loss,
    wait_for_every_group,
)

METHODS = ("ddp", "ddp-edgc", "diloco", "diloco-edgc")
# DiLoCo's outer Nesterov SGD at lr 0.7 (Douillard et al., 2023); momentum 0.5, not their 0.9: a run of
# six outer steps overshoots with 0.9 (validation loss 5.74 against 5.60 after 60 steps of three tiny groups).
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.5


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", choices=METHODS, required=True)
    p.add_argument("--sync-every", type=int, default=10, help="DiLoCo: inner steps per outer step (H)")
    p.add_argument("--fragments", type=int, default=1, help="DiLoCo: model fragments (> 1: Streaming DiLoCo)")
    p.add_argument(
        "--outer-sync",
        default="quant3-2s",
        help="diloco-edgc: a registered sync method's name with DiLoCo's modifiers (e.g. "
        "sparse64-decay0.95-mom0-lr1, `edgc.sync.sync_methods.outer_sync_spec`), "
        "or edgc (PowerSGD with --edgc's fields)",
    )
    p.add_argument("--eval-every", type=int, default=5, help="group 0 keeps the shared model every N inner steps")
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--n-embd", type=int, default=None)
    p.add_argument("--n-head", type=int, default=None)
    add_worker_flags(p)
    p.set_defaults(replicas=3, steps=60, eval_batches=2)
    args = p.parse_args(argv)
    args.compressor = "edgc" if args.method == "ddp-edgc" else "none"  # torchft_sync's name for the DDP kind
    return args


def fragments_of(module: torch.nn.Module, count: int) -> list[torch.nn.Module]:
    """GPT-2's modules in order (embeddings, blocks, final norm) cut into ``count`` contiguous
    fragments of similar parameter counts; together they hold every parameter once."""
    t = module.transformer
    parts = [t.wte, t.wpe, *t.h, t.ln_f]
    sizes = [sum(p.numel() for p in part.parameters()) for part in parts]
    if count > len(parts):
        raise ValueError(f"--fragments: at most {len(parts)} for this model, got {count}")
    total, cuts, running = sum(sizes), [], 0
    for index, size in enumerate(sizes[:-1]):
        running += size
        left = count - 1 - len(cuts)  # cuts still to make
        # cut after this part if the next boundary lies before its middle, or if the parts left are needed
        if left and (running - size / 2 >= total * (len(cuts) + 1) / count or len(parts) - index - 1 == left):
            cuts.append(index + 1)
    bounds = [0, *cuts, len(parts)]
    return [torch.nn.ModuleList(parts[a:b]) for a, b in zip(bounds, bounds[1:])]


def diloco_sync(args, module, inner, group: int, heals: list, edgc_fields: dict):
    """(DiLoCo, manager) of one replica group: torchft's or EDGC's, on a synchronous-quorum Manager."""
    manager = replica_manager(
        args,
        group,
        module,
        inner,
        heals,
        use_async_quorum=False,  # both need the quorum first
        init_sync=False,
    )
    fragments = fragments_of(module, args.fragments) if args.fragments > 1 else [module]
    spec = {"sync": None} if args.method == "diloco" or args.outer_sync == "edgc" else outer_sync_spec(args.outer_sync)
    lr, momentum = spec.get("outer_lr", OUTER_LR), spec.get("outer_momentum", OUTER_MOMENTUM)
    # one outer optimizer per fragment: torchft's steps every parameter that has a gradient, and at a
    # fragment's outer step the others still hold the inner step's gradients
    outer = [torch.optim.SGD(f.parameters(), lr=lr, momentum=momentum, nesterov=momentum > 0) for f in fragments]
    if args.method == "diloco":
        from torchft.local_sgd import DiLoCo

        return DiLoCo(manager, fragments, inner, outer, args.sync_every, should_quantize=False), manager
    from edgc.integrations.torchft import DiLoCo as EDGCDiLoCo

    if spec["sync"] is not None:
        decay = spec.get("decay", 1.0)
        diloco = EDGCDiLoCo(
            manager, fragments, inner, outer, args.sync_every, sync_method=spec["sync"], error_feedback_decay=decay
        )
        return diloco, manager
    outer_steps = args.steps * args.fragments // args.sync_every
    config = EDGCConfig.from_dict({"total_steps": max(1, outer_steps), **edgc_fields})
    return EDGCDiLoCo(manager, fragments, inner, outer, args.sync_every, config), manager


def shared_model(module: torch.nn.Module, diloco) -> list[torch.Tensor]:
    """The model every replica holds, in ``module.parameters()`` order: θ_global for DiLoCo (each
    fragment's copy at its last outer step), the parameters themselves for DDP."""
    if diloco is None:
        return [p.detach() for p in module.parameters()]
    held: dict[int, torch.Tensor] = {}
    for fragment in torchft_adapter.fragments(diloco):
        if hasattr(fragment, "original_parameters"):  # torchft's: by the fragment's parameter names
            for name, p in torchft_adapter.fragment_module(fragment).named_parameters():
                held[id(p)] = fragment.original_parameters[name]
        else:  # EDGC's: a list beside the parameters
            held.update({id(p): t for p, t in zip(fragment.params, fragment.original)})
    return [held[id(p)] for p in module.parameters()]


class Recorder:
    """The step log, the stop cap, and group 0's copies of the shared model on its training clock."""

    def __init__(self, out: Path, group: int, eval_every: int, write):
        self.out, self.group, self.eval_every, self.write = out, group, eval_every, write
        self.copies: list[tuple[int, float, list[torch.Tensor]]] = []
        self.start = time.perf_counter()
        self.paused = 0.0  # time spent keeping copies, off the clock

    def clock(self) -> float:
        return time.perf_counter() - self.start - self.paused

    def cap(self, steps: int) -> int:
        stop = self.out / "stop.json"
        return min(steps, json.loads(stop.read_text())["steps"]) if stop.exists() else steps

    def keep(self, step: int, tensors: list[torch.Tensor], last: bool = False) -> None:
        """A copy of the shared model after ``step`` inner steps (every eval_every, and the last)."""
        if self.group != 0 or (step % self.eval_every and not last) or any(s == step for s, _, _ in self.copies):
            return
        t = time.perf_counter()
        clock = self.clock()
        self.copies.append((step, clock, [x.detach().clone() for x in tensors]))
        self.paused += time.perf_counter() - t


def train_ddp(model, module, optimizer, state, manager, sampler, cfg, rec: Recorder, heals: list) -> None:
    """One sync per step (torchft DDP, with or without EDGC), until the run's last step is committed."""
    schedule = lr_lambda(cfg)
    raw = 4 * sum(p.numel() for p in module.parameters())
    attempts = 0
    rec.keep(0, shared_model(module, None))
    while manager.current_step() < rec.cap(cfg.steps):
        start, heals_before = time.perf_counter(), len(heals)
        written = socket_writes()
        manager.start_quorum()
        step, committed, loss = sync_step(
            model, module, optimizer, manager, sampler, cfg, schedule, manager.current_step(), attempts
        )
        written = socket_writes() - written
        attempts += not committed
        metrics = state.last_step_metrics if state is not None else {}
        rec.write(
            kind="step",
            step=step,
            t=time.time(),
            step_s=time.perf_counter() - start,
            loss=loss,
            sync=True,
            outer=step,
            committed=committed,
            participants=manager.num_participants(),
            participating=manager.participating_rank() is not None,
            healed=any(h > 0 for h in heals[heals_before:]),
            bytes=metrics.get("bytes_sent", raw if state is None else None),
            wire=written,
            rank=metrics.get("rank"),
        )
        if committed:
            rec.keep(step + 1, shared_model(module, None))


def train_diloco(diloco, manager, module, inner, sampler, cfg, rec: Recorder, heals: list, rejoin: bool) -> None:
    """Inner steps; the inner optimizer's hook takes the outer step every H / fragments of them. A
    restarted group (``rejoin``) has no inner progress to give: its first step is an empty one at the
    sync point, where it heals from a peer and joins the outer step the others are taking."""
    verdicts = record_verdicts(manager)
    unit = torchft_adapter.sync_every(diloco)  # inner steps between two outer steps (one fragment's each)
    attempts = 0
    rec.keep(0, shared_model(module, diloco))
    with diloco:
        if rejoin:
            torchft_adapter.set_local_step(diloco, unit - 1)
            inner_step(diloco, manager, module, inner, None, cfg, rec, heals, verdicts)
        while manager.current_step() * unit + torchft_adapter.local_step(diloco) < rec.cap(cfg.steps):
            attempts += inner_step(diloco, manager, module, inner, (sampler, attempts), cfg, rec, heals, verdicts)


def record_verdicts(manager) -> list[bool]:
    """Every ``should_commit`` verdict of the manager (both DiLoCos ask once per outer step)."""
    verdicts: list[bool] = []
    ask = manager.should_commit

    def should_commit(*args, **kwargs) -> bool:
        verdicts.append(ask(*args, **kwargs))
        return verdicts[-1]

    manager.should_commit = should_commit
    return verdicts


def inner_step(diloco, manager, module, inner, data, cfg, rec: Recorder, heals: list, verdicts: list) -> int:
    """One inner step (``data`` None: an empty one, no gradient), its line; the inner steps to run
    again (a discarded outer step's)."""
    start, heals_before, asked = time.perf_counter(), len(heals), len(verdicts)
    unit = torchft_adapter.sync_every(diloco)
    step = manager.current_step() * unit + torchft_adapter.local_step(diloco)
    syncs = torchft_adapter.local_step(diloco) == unit - 1
    loss = None
    if data is not None:
        sampler, attempts = data
        x, y = batch(sampler, step + attempts)  # a fresh batch for a step run again
        loss = forward_backward(module, module, x, y, cfg)
        for group in inner.param_groups:
            group["lr"] = cfg.lr * lr_lambda(cfg)(step)
    if syncs:
        rec.write(kind="sync_start", step=step, outer=manager.current_step(), t=time.time())
    written = socket_writes()
    inner.step()  # on a sync step: the outer step, inside the hook
    written = socket_writes() - written
    inner.zero_grad()
    record, committed = {}, False
    if syncs:
        committed = len(verdicts) > asked and verdicts[-1]
        outer = manager.current_step() - committed  # after a heal: the step the others were at
        step = outer * unit + unit - 1
        record = dict(
            outer=outer,
            committed=committed,
            participants=manager.num_participants(),
            participating=manager.participating_rank() is not None,
            healed=any(h > 0 for h in heals[heals_before:]),
            wire=written,
            **payload(diloco, outer % len(torchft_adapter.fragments(diloco))),
        )
    rec.write(
        kind="step", step=step, t=time.time(), step_s=time.perf_counter() - start, loss=loss, sync=syncs, **record
    )
    if committed:
        rec.keep(step + 1, shared_model(module, diloco))
    return unit if syncs and not committed else 0


def socket_writes() -> int:
    """Bytes this process has written so far (``wchar`` of /proc/self/io: every write(2)-family call,
    gloo's socket writes included, whatever the library's own counters say). Around an outer step
    that writes no file, its difference is what the step put on its sockets: the wire of one process."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar")


def payload(diloco, fragment: int) -> dict:
    """The bytes one replica put into the outer step's all-reduce, and EDGC's rank."""
    last = getattr(diloco, "last_outer_step", None)
    if last is not None:  # EDGC's DiLoCo reports its own
        return {"bytes": last.get("payload_bytes", last.get("bytes_sent")), "rank": last.get("rank")}
    params = torchft_adapter.fragment_module(torchft_adapter.fragments(diloco)[fragment]).parameters()
    return {"bytes": sum(p.numel() * p.element_size() for p in params), "rank": None}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.advertise:  # torchft's servers advertise socket.gethostname(): make it this namespace's address
        socket.gethostname = lambda: args.advertise  # type: ignore[assignment]
    out = Path(args.out)
    log = open(out / f"group{args.group}.jsonl", "a", buffering=1)

    def write(**record) -> None:
        log.write(json.dumps(record) + "\n")

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    write(kind="start", pid=os.getpid(), t=time.time(), restart=restart)
    cfg = train_config(args)
    data = prepare_data(args.data, args.vocab_size, 0.1, args.max_chars, None, log=lambda *a, **k: None)
    seed_everything(cfg.seed)
    module = build_model(model_shape(cfg.preset, data.vocab_size, cfg.seq_len, args.n_layer, args.n_embd, args.n_head))
    write(kind="model", shapes=[list(p.shape) for p in module.parameters()])  # what a priced sync's layout needs
    optimizer = make_optimizer(module, cfg, torch.device("cpu"))
    sampler = BlockSampler(data.train, cfg.seq_len, cfg.micro_batch, args.group, args.replicas, cfg.seed)
    edgc_fields = json.loads(args.edgc)
    heals: list[int] = []
    diloco = None
    if args.method.startswith("ddp"):
        config = EDGCConfig.from_dict({"total_steps": args.steps, **edgc_fields})
        model, state, manager = torchft_sync(args, module, optimizer, config, args.group, heals, init_sync=False)
    else:
        diloco, manager = diloco_sync(args, module, optimizer, args.group, heals, edgc_fields)
    if restart == 0:  # every group builds the same model from the seed: no initial sync (init_sync=False)
        wait_for_every_group(manager, args.replicas, 3 * args.timeout)
    rec = Recorder(out, args.group, args.eval_every, write)
    if diloco is None:
        train_ddp(model, module, optimizer, state, manager, sampler, cfg, rec, heals)
    else:
        train_diloco(diloco, manager, module, optimizer, sampler, cfg, rec, heals, rejoin=restart > 0)
    shared = shared_model(module, diloco)
    done = manager.current_step() * (torchft_adapter.sync_every(diloco) if diloco is not None else 1)
    rec.keep(done, shared, last=True)
    write(
        kind="final",
        t=time.time(),
        steps=done,
        checksum=tensors_digest(shared),
        heals=len([h for h in heals if h > 0]),
        tensors=len(shared),  # what torchft's DiLoCo all-reduces one by one
    )
    manager.shutdown(wait=False)
    evaluate(module, rec, data, cfg, args.replicas, write)


def tensors_digest(tensors: list[torch.Tensor]) -> str:
    holder = torch.nn.Module()
    holder.values = torch.nn.ParameterList(
        [torch.nn.Parameter(t.detach().clone(), requires_grad=False) for t in tensors]
    )
    return parameter_digest(holder)


@torch.no_grad()
def evaluate(module, rec: Recorder, data, cfg, replicas: int, write) -> None:
    """Group 0, after the run: the validation loss of every copy of the shared model it kept."""
    for step, clock, tensors in rec.copies:
        for p, t in zip(module.parameters(), tensors):
            p.copy_(t)
        write(kind="eval", step=step, clock=clock, val_loss=validation_loss(module, data, cfg, replicas))


if __name__ == "__main__":
    main()
