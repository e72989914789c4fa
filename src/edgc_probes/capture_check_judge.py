"""The capture checker's verdict (`edgc_probes.capture_check`): the record of the checked steps
(`edgc_probes.capture_check_trace.Trace`) turned into violations, each said once, where it is made."""

from __future__ import annotations

from dataclasses import dataclass

from .capture_check_trace import Call, OpRecord, StepTrace, Trace

OP_SEQUENCE = "op sequence"
ARGUMENTS = "arguments"
FRESH_BUFFER = "fresh buffer"
CHANGED_BUFFER = "changed buffer"
UNDECLARED = "undeclared buffer"
HOST_SYNC = "host sync"
DATA_DEPENDENT = "data-dependent size"
COLLECTIVE = "collective in region"
WAIT = "wait in region"
NEW_REGION = "new region"
KINDS = (
    OP_SEQUENCE,
    ARGUMENTS,
    FRESH_BUFFER,
    CHANGED_BUFFER,
    UNDECLARED,
    HOST_SYNC,
    DATA_DEPENDENT,
    COLLECTIVE,
    WAIT,
    NEW_REGION,
)


@dataclass(frozen=True)
class Violation:
    """What breaks capture: its ``kind`` (one of `KINDS`), the region (or stretch of work) it is in, the
    site (``file:line (function)``) to change, and what is wrong."""

    kind: str
    region: str
    site: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} in {self.region}, at {self.site}: {self.detail}"


def _name(call: Call | None) -> str:
    return call.name if call is not None else "the step"


class _Found:
    def __init__(self):
        self.violations: list[Violation] = []
        self._seen: set[tuple] = set()

    def add(self, kind: str, region: str, site: str, detail: str) -> None:
        """Once per kind and line to change (a line in several regions' work is changed once)."""
        if (kind, site) not in self._seen:
            self._seen.add((kind, site))
            self.violations.append(Violation(kind, region, site, detail))


def judge(trace: Trace, period: int = 1) -> list[Violation]:
    """The violations of the steps in ``trace``. Where any step called a region, the regions are judged:
    each `GraphRegion`'s every call against its call before (a replay repeats one capture, whatever
    the step), and at each place of a step the same region as ``period`` steps before. Else the
    library's stretches of work, each step against the ``period``-th before it."""
    explicit = any(call.explicit for step in trace.steps for call in step.calls)
    found = _Found()
    for kind, call, site, detail in trace.found:
        found.add(kind, _name(call), site, detail)
    for birth, used in trace.escapes.values():
        if birth.call.explicit == explicit:
            site = birth.frame.site if birth.frame is not None else birth.op
            found.add(
                FRESH_BUFFER,
                birth.call.name,
                site,
                f"{birth.describe(site=False)} makes a new storage at every call, used after it by {used}: "
                "a buffer that crosses a region's boundary is made once and kept",
            )
    if explicit:
        _judge_regions(trace, period, found)
        _undeclared(trace, found)
        return found.violations
    for k in range(period, len(trace.steps)):
        earlier, later = trace.steps[k - period], trace.steps[k]
        labels = (f"step {k - period}", f"step {k}")
        _compare_ops([op for op in earlier.ops if op.library], [op for op in later.ops if op.library], labels, found)
        before = [call for call in earlier.calls if not call.explicit]
        for old, call in zip(before, [call for call in later.calls if not call.explicit]):
            _compare_inputs(trace, old, call, labels[0], found)
    return found.violations


def _judge_regions(trace: Trace, period: int, found: _Found) -> None:
    ops_of: dict[int, list[OpRecord]] = {}
    for step in trace.steps:
        for op in step.ops:
            if op.call is not None and op.call.explicit:
                ops_of.setdefault(id(op.call), []).append(op)
    last: dict[int, tuple[str, Call]] = {}  # id(region) → (where, its last call)
    for k, step in enumerate(trace.steps):
        for call in (call for call in step.calls if call.explicit):
            where = f"call of {call.name} in step {k}"
            if id(call.region) in last:
                before, old = last[id(call.region)]
                _compare_ops(ops_of.get(id(old), []), ops_of.get(id(call), []), (before, where), found)
                _compare_inputs(trace, old, call, before, found)
            last[id(call.region)] = (f"its call in step {k}", call)
    for k in range(period, len(trace.steps)):
        before = _places(trace.steps[k - period])
        for place, call in _places(trace.steps[k]).items():
            old = before.get(place)
            if old is not None and old.region is not call.region:
                found.add(
                    NEW_REGION,
                    call.name,
                    next(iter(call.inputs.values()), ("", "?"))[1],
                    f"not the GraphRegion called here {period} step(s) before: a region is made once and kept "
                    "(one per buffer in turn: check with that period), or it captures at every step",
                )


def _places(step: StepTrace) -> dict[tuple[str, int], Call]:
    """The step's region calls by place: (name, occurrence)."""
    places, seen = {}, {}
    for call in step.calls:
        if call.explicit:
            seen[call.name] = seen.get(call.name, -1) + 1
            places[(call.name, seen[call.name])] = call
    return places


def _differences(earlier: tuple, later: tuple) -> str:
    if len(earlier) != len(later):
        return f"{len(earlier)} arguments before, {len(later)} now"
    pairs = [(j, a, b) for j, (a, b) in enumerate(zip(earlier, later)) if a != b]
    return "; ".join(f"argument {j}: {a} before, {b} now" for j, a, b in pairs[:3])


def _compare_ops(earlier: list[OpRecord], later: list[OpRecord], labels: tuple[str, str], found: _Found) -> None:
    """``labels``: what ran ``earlier`` and ``later`` (a step, a region's call)."""
    before, now = labels
    for i, (a, b) in enumerate(zip(earlier, later)):
        if a.op != b.op or _name(a.call) != _name(b.call):
            found.add(
                OP_SEQUENCE,
                _name(b.call),
                b.site,
                f"operator {i} of {now} is {b.op} (in {_name(b.call)}) where {before} ran {a.op} "
                f"at {a.site} (in {_name(a.call)})",
            )
            return
        if a.signature != b.signature:
            found.add(
                ARGUMENTS,
                _name(b.call),
                b.site,
                f"{b.op}, {before} → {now}: " + _differences(a.signature, b.signature),
            )
    if len(earlier) != len(later):
        extra = (later if len(later) > len(earlier) else earlier)[min(len(earlier), len(later))]
        found.add(
            OP_SEQUENCE,
            _name(extra.call),
            extra.site,
            f"{now} ran {len(later)} operators, {before} {len(earlier)}; the first one of only one of them: {extra.op}",
        )


def _compare_inputs(trace: Trace, old: Call, call: Call, before: str, found: _Found) -> None:
    """Each storage crossing into ``call`` is the one that crossed into ``old`` at its place."""
    if len(old.inputs) != len(call.inputs):
        return  # the operators differ too, said once
    for old_key, (key, (op, site)) in zip(old.inputs, call.inputs.items()):
        birth = trace.births.get(key)
        if key == old_key or (birth is not None and birth.call is not None and birth.call.explicit == call.explicit):
            continue  # the same storage, or one made in a call: its fresh buffer is said where it is made
        made = birth.describe() if birth is not None else "before the checked steps"
        found.add(
            CHANGED_BUFFER,
            call.name,
            birth.frame.site if birth is not None and birth.frame is not None else site,
            f"{op} at {site} uses a storage that is not the one {before} used there: made {made}",
        )


def _undeclared(trace: Trace, found: _Found) -> None:
    for step in trace.steps:
        for call in step.calls:
            if not call.explicit:
                continue
            for key, (op, site) in call.inputs.items():
                if key in call.declared:
                    continue
                birth = trace.births.get(key)
                made = birth.describe() if birth is not None else "before the checked steps"
                found.add(
                    UNDECLARED,
                    call.name,
                    site,
                    f"{op} uses a storage made {made} that is not among the region's buffers: a replay "
                    "would not notice it change",
                )
