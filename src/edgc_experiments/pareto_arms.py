"""The arms of `edgc experiment pareto` (pareto.py): the byte budgets, what every arm shares (the
warm-up, the window), and each arm's rank schedule at a budget."""

from __future__ import annotations

import math

BUDGETS = (2, 4, 8)


HAND_SET = ("hand-3", "hand-2")


RANK_CHANGES = ("warm", "truncate")


DERIVED = (
    "warm-vs-truncate",
    "per-change-",
    "per-step-",
    "compression-cost",
)  # entries of the paired stats that are not arms


SLOW_PERIOD = 3  # windows per rank in the slow alternation: 1/3 of the changes at the same bytes


def compressed_steps(steps: int) -> int:
    """Steps after the shared 10 % warm-up (`base_fields`)."""
    return steps - math.floor(0.1 * steps)


def base_fields(steps: int) -> dict:
    """What every arm shares: the 10 % warm-up (no error test, so only the rank differs) and `edgc train`'s window."""
    from edgc_train.config import scaled_edgc_defaults

    scaled = scaled_edgc_defaults(steps)
    return {
        "total_steps": steps,
        "warmup_fraction": 0.1,
        "warmup_error_test": False,
        "window": scaled["window"],
        "iteration_sample_ratio": scaled["iteration_sample_ratio"],
    }


def arms(
    budget: int, steps: int, signals: list[str], hand_set: list[str], change_cost: bool, rank_change: str | None = None
) -> dict[str, dict]:
    """{arm name: EDGCConfig fields (`EDGCConfig.from_dict`'s)} at this budget; ``rank_change``: the rule of
    every arm that does not set its own (None: EDGCConfig's default)."""
    base = base_fields(steps)
    if rank_change is not None:
        base["engine"] = {"rank_change": rank_change}
    n = compressed_steps(steps)
    start = steps - n

    def schedule(*parts: tuple[float, int]) -> tuple:
        """Ranks for fractions of the compressed steps, as absolute (step, rank) entries."""
        entries, at = [], start
        for fraction, rank in parts:
            entries.append((at, rank))
            at += round(fraction * n)
        return tuple(entries)

    result = {"static": {**base, "r_max": budget, "r_min": budget, "adaptive": False}}
    for signal in signals:
        result[f"budget-{signal}"] = {
            **base,
            "r_max": 2 * budget,
            "rank_budget": float(budget),
            "budget_signal": signal,
        }
    half = max(1, budget // 2)
    if "hand-3" in hand_set:
        result["hand-3"] = {
            **base,
            "r_max": 2 * budget,
            "adaptive": False,
            "rank_schedule": schedule((2 / 9, 2 * budget), (3 / 9, budget), (4 / 9, half)),
        }
    if "hand-2" in hand_set:
        result["hand-2"] = {
            **base,
            "r_max": 2 * budget,
            "adaptive": False,
            "rank_schedule": schedule((1 / 3, 2 * budget), (2 / 3, half)),
        }
    if change_cost:
        low, high = budget // 2, budget + budget // 2
        for prefix, period in (("alt", 1), (f"alt{SLOW_PERIOD}", SLOW_PERIOD)):
            # the same ranks in the same share of the same windows; only the number of changes differs
            windows = range(start, steps, base["window"])
            entries = tuple(
                (s, high if (k // period) % 2 == 0 else low) for k, s in enumerate(windows) if k % period == 0
            )
            for mode in RANK_CHANGES:
                result[f"{prefix}-{mode}"] = {
                    **base,
                    "r_max": high,
                    "adaptive": False,
                    "rank_schedule": entries,
                    "engine": {"rank_change": mode},
                    "shadow_ranks": (low, high),
                }
                if period == 1:  # the compression cost is read off these: twins that are the never-changed run
                    result[f"{prefix}-{mode}"]["shadow_twin"] = "run"
        result["cold"] = {**result["static"], "cold_start": True}  # an instrument field (`pareto_train`)
        # static's excess over an independent twin at its own rank: the level any two distinct iterations settle to
        result["static"] = {**result["static"], "shadow_ranks": (budget,)}
    return result
