"""Every CI run draws the same 360 random plans over thirteen model families (the built-ins,
two small models that are not transformers, a CNN with batch norm, a model of everyday
idioms, routed experts): splits of any dim
(reductions included), value splits, replicas, placements, orders, recompute, swaps,
split backwards and split updates, and now and then a mistake. Each plan must be refused
with an error that names an op, tensor or device, or train like one device.

``python benchmarks/fuzz.py`` prints the same table (``--plans 550`` and more for a longer
draw); ``--show`` the failures' plans.
"""

import time
from collections import Counter

import pytest

from tests.fuzz.trials import NAMES, run_trials, summary

PLANS = 360  # seeds 0..359: every family gets 27 or 28


@pytest.mark.slow
def test_random_plans_are_refused_by_name_or_train_like_one_device():
    start = time.perf_counter()
    outcomes = run_trials(range(PLANS))
    print("\n" + summary(outcomes, time.perf_counter() - start))
    failed = [o for o in outcomes if o.status == "failed"]
    assert not failed, "\n\n".join(
        f"seed {o.seed} ({o.family}) failed at {o.stage}: {o.error}: {o.message}\n"
        f"{o.reproduction}" for o in failed)
    accepted = Counter(o.family for o in outcomes if o.status == "accepted")
    assert all(accepted[name] >= 12 for name in NAMES), accepted  # mostly real plans
    refused = Counter(o.error for o in outcomes if o.status == "rejected")
    assert {"DeadlockError", "UnassignedOpError", "PlanError"} <= set(refused), refused
