"""Pure rank policies: plans and decisions, CQM, the paper's mappings, rank splits, budget signals.

Modules:
    plans.py      What the controller plans for a step and what a decision carries (pure data, no logic).
    rank_model.py CQM — the compression quantification model: rank ↔ truncation error ↔ entropy.
    rank_rules.py The paper's rank rules (DAC, §2.5) and the noise gate that makes them follow the entropy trend.
    rank_split.py How a state's rank is shared among its experts' matrices: a rank split, registered by name.
    signals.py    The byte budget's signals: what tells the budget controller that the run is still in its early
                  regime.
"""
