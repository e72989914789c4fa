"""Compare two `edgc bench` folders method by method (an A/B of two code versions or settings)
and write the table into a markdown file between <!-- MARKER:start/end -->.

    python scripts/to_docs.py bench-ab A B --label-a "hand-written TP" --label-b "DTensor TP" \
        --marker bench-tp-ab [--doc PAGE]

Only methods both folders ran are compared. Every number comes from the folders' results.json;
nothing is typed by hand.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from doc_blocks import write


def load(folder: Path) -> dict:
    path = folder / "results.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{path}: not a finished `edgc bench` folder ({exc})") from None


def describe(label: str, data: dict) -> str:
    loads = data.get("load_start") or [float("nan")], data.get("load_end") or [float("nan")]
    return (
        f"**{label}**: `{data['command']}` — {data['date']}, load average {loads[0][0]:.1f} at start, "
        f"{loads[1][0]:.1f} at end"
    )


def table(a: dict, b: dict, label_a: str, label_b: str) -> str:
    rows_b = {row["method"]: row for row in b["rows"]}
    lines = [
        f"| method | step s, {label_a} | step s, {label_b} | {label_b} ÷ {label_a} | DP MB/step, {label_a} "
        f"| DP MB/step, {label_b} | final val loss, {label_a} | final val loss, {label_b} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in a["rows"]:
        other = rows_b.get(row["method"])
        if other is None:
            continue
        lines.append(
            f"| {row['method']} | {row['step_s']:.3f} | {other['step_s']:.3f} | "
            f"{other['step_s'] / row['step_s']:.2f}× | {row['bytes_per_step'] / 1e6:.2f} | "
            f"{other['bytes_per_step'] / 1e6:.2f} | {row['val_loss']:.4f} | {other['val_loss']:.4f} |"
        )
    if len(lines) == 2:
        raise SystemExit("the two folders have no method in common")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="to_docs.py bench-ab", description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--label-a", default="A")
    parser.add_argument("--label-b", default="B")
    parser.add_argument("--marker", required=True, help="the block's name: <!-- MARKER:start/end -->")
    parser.add_argument("--doc", type=Path, help="the page (default: the one that holds the block)")
    args = parser.parse_args(argv)
    a, b = load(args.a), load(args.b)
    body = "\n\n".join(
        [
            describe(args.label_a, a),
            describe(args.label_b, b),
            table(a, b, args.label_a, args.label_b),
            "Step times are medians over all steps (rank 0); DP MB/step is the mean over all steps.",
        ]
    )
    page = write(args.marker, body, args.doc, add_missing=True)
    print(f"{page}: {args.marker} from {args.a} and {args.b}")
    return 0
