"""One trial: draw a plan from a seed, compile it, train it as threads, compare it with
one device. Its outcome is accepted (and equal), rejected with a named error, or failed.

    python -m tests.fuzz [--plans 500] [--families gpt towers] [--first 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass

import chronotope as ct
from chronotope.errors import ChronotopeError
from chronotope.runtime.local import run_in_threads
from chronotope.runtime.reference import compare
from tests.fuzz.families import FAMILIES, OPTIM, family, reference
from tests.fuzz.plans import RandomPlan, script

TOLERANCE = 1e-5
TIMEOUT = 30.0  # seconds a rank waits on another before the run counts as hung
NAMES = sorted(FAMILIES)


@dataclass(frozen=True)
class Outcome:
    """What became of one plan. ``status``: accepted, rejected or failed; ``stage``: where
    it was refused or failed (plan, compile, run, compare); ``error``: the error's class."""

    seed: int
    family: str
    ndevices: int
    style: str
    status: str
    stage: str = ""
    error: str = ""
    message: str = ""
    reproduction: str = ""


def family_of(seed: int) -> str:
    return NAMES[seed % len(NAMES)]


def steps_of(seed: int) -> int:
    """One training step, or two every other round of the families (the second step
    runs on updated weights, and through the refresh of weights kept in one place)."""
    return 1 + (seed // len(NAMES)) % 2


def trial(seed: int) -> Outcome:
    name = family_of(seed)
    workload, graph = family(name)
    drawn = RandomPlan(graph, seed)
    done = {"seed": seed, "family": name, "ndevices": drawn.ndevices, "style": drawn.style}
    stage = "plan"
    try:
        plan = drawn.build()
        stage = "compile"
        program = ct.compile(plan)
        stage = "run"
        steps = steps_of(seed)
        run = run_in_threads(program, workload, steps, OPTIM, timeout=TIMEOUT)
    except ChronotopeError as e:
        refused = stage in ("plan", "compile") and names_something(str(e), drawn.plan)
        if refused and "bug in chronotope" not in str(e):
            return Outcome(**done, status="rejected", stage=stage, error=type(e).__name__,
                           message=str(e))
        return failed(done, stage, e, drawn)
    except Exception as e:  # noqa: BLE001  (any other exception is a failure to report)
        return failed(done, stage, e, drawn)
    diff = compare(run, reference(name, steps))
    if not diff.within(TOLERANCE):
        return Outcome(**done, status="failed", stage="compare", error="Mismatch",
                       message=str(diff), reproduction=script(name, drawn.ndevices, drawn.calls))
    return Outcome(**done, status="accepted")


def failed(done: dict, stage: str, e: BaseException, drawn: RandomPlan) -> Outcome:
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    at = f" (at {where.filename.rsplit('/', 1)[-1]}:{where.lineno})" if where else ""
    return Outcome(**done, status="failed", stage=stage, error=type(e).__name__,
                   message=f"{e}{at}",
                   reproduction=script(done["family"], drawn.ndevices, drawn.calls))


def names_something(message: str, plan: ct.Plan) -> bool:
    """Whether an error names an op (or a piece of one), a tensor, a parameter or a device."""
    graph = plan.graph
    names = {op.name for op in graph.ops} | set(graph.params)
    names |= {t.name for op in graph.ops for t in (*op.inputs, *op.outputs)}
    if re.search(r"\bdevices? \d", message):
        return True
    return any(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", message) for n in names)


def run_trials(seeds: range | list[int]) -> list[Outcome]:
    return [trial(seed) for seed in seeds]


def summary(outcomes: list[Outcome], seconds: float | None = None) -> str:
    """One line of totals, then one per family: accepted, and rejected by error class."""
    def counts(rows: list[Outcome]) -> str:
        status = Counter(o.status for o in rows)
        errors = Counter(f"{o.error}@{o.stage}" for o in rows if o.status == "rejected")
        refused = ", ".join(f"{k} {v}" for k, v in sorted(errors.items()))
        return (f"{len(rows)} plans: {status['accepted']} accepted, {status['rejected']} "
                f"rejected ({refused or 'none'}), {status['failed']} failed")

    took = f" in {seconds:.0f} s" if seconds is not None else ""
    lines = [f"fuzz{took}: {counts(outcomes)}"]
    for name in NAMES:
        mine = [o for o in outcomes if o.family == name]
        if mine:
            lines.append(f"  {name:10} {counts(mine)}")
    for o in outcomes:
        if o.status == "failed":
            lines.append(f"FAILED seed {o.seed} ({o.family}, {o.ndevices} devices, {o.style}) "
                         f"at {o.stage}: {o.error}: {o.message.splitlines()[0][:300]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=500, help="how many seeds to try")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--families", nargs="+", choices=NAMES,
                        help="only seeds that draw for these families")
    parser.add_argument("--json", action="store_true", help="every outcome as JSON")
    parser.add_argument("--show", action="store_true",
                        help="print each failure's reproduction")
    args = parser.parse_args(argv)
    seeds = [s for s in range(args.first, args.first + args.plans)
             if not args.families or family_of(s) in args.families]
    start = time.perf_counter()
    outcomes = run_trials(seeds)
    took = time.perf_counter() - start
    if args.json:
        print(json.dumps({"seconds": took, "outcomes": [asdict(o) for o in outcomes]}, indent=1))
    else:
        print(summary(outcomes, took))
        if args.show:
            for o in outcomes:
                if o.status == "failed":
                    print(f"\n# seed {o.seed}: {o.error}: {o.message}\n{o.reproduction}")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
