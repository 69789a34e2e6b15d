"""Measured compute: instruction timing in the runtime, and the calibration fit."""

import pytest

from chronotope.compile import compile
from chronotope.compile.codegen import render
from chronotope.compile.program import Free
from chronotope.compile.simulate import features
from chronotope.cost.times import Calibration
from chronotope.measure import calibrate, measure_ops
from chronotope.measure.calibrate import _nonnegative_least_squares
from chronotope.policies import mesh
from chronotope.runtime.local import Optim, Rank, rank_specs
from chronotope.runtime.transport import ThreadTransport
from tests.policies.plan_testing import captured


def test_ticks_time_every_instruction_of_a_step():
    w, g = captured("gpt")
    program = compile(mesh(g, dp=1, micro=2), comm="p2p")
    spec = rank_specs(program, w)[0]
    spec.code = render(program, 0, ticks=True)
    rank = Rank(spec, ThreadTransport(), Optim("sgd", 0.0))
    rank.ticks = []
    rank.step()
    assert len(rank.ticks) == sum(not isinstance(i, Free) for i in program.ranks[0])
    assert rank.ticks == sorted(rank.ticks)
    assert "rt.tick()" not in program.code(0)  # what users run has none


def test_the_fit_recovers_costs_and_keeps_them_nonnegative():
    # seconds = 2e-5 per Forward + 5e-5 per Backward + 1.5 x compute
    rows = [[1, 0, c] for c in (1e-3, 4e-3, 2e-4)] + [[0, 1, c] for c in (3e-3, 0.0)]
    seconds = [2e-5 * a + 5e-5 * b + 1.5 * c for a, b, c in rows]
    assert _nonnegative_least_squares(rows, seconds) == pytest.approx([2e-5, 5e-5, 1.5])
    # a column whose best coefficient is negative is left out: no cost below zero
    rows = [[x, y] for x, y in zip((1.0, 2.0, 3.0, 4.0), (1.0, 0.0, 1.0, 0.0))]
    coef = _nonnegative_least_squares(rows, [x - 0.1 * y for x, y in rows])
    assert coef[1] == 0.0 and coef[0] > 0


def test_calibration_prices_instructions_by_kind():
    w, g = captured("gpt")
    program = compile(mesh(g, dp=1, micro=2), comm="p2p")
    cal = Calibration(compute_scale=2.0, overhead={"Forward": 1e-5, "Backward": 3e-5},
                      per_piece=1e-6, per_byte=1e-9)
    code = [i for i in program.ranks[0] if not isinstance(i, Free)]
    forward = next(i for i in code if type(i).__name__ == "Forward")
    backward = next(i for i in code if type(i).__name__ == "Backward")
    assert cal.seconds(*features(forward), 1e-3, 1e9) == pytest.approx(1e-5 + 2e-3)
    pieces = 1e-6 * len(backward.ops)
    assert cal.seconds(*features(backward), 0.0, 1e9) == pytest.approx(3e-5 + pieces)
    copying = next(i for i in code if type(i).__name__ == "Assemble" and not i.is_view)
    nbytes = copying.dtype.itemsize
    for n in copying.shape:
        nbytes *= n
    assert cal.seconds(*features(copying), 0.0, 1e9) == pytest.approx(1e-9 * nbytes)


@pytest.mark.slow
def test_calibrate_fits_this_machine():
    w, g = captured("gpt")
    cal = calibrate(g, w, measure_ops(g, w, repeats=1), steps=2)
    assert cal.compute_scale >= 0 and cal.per_piece >= 0
    assert {"Forward", "Backward", "Load", "Grad"} <= set(cal.overhead)
    assert all(v >= 0 for v in cal.overhead.values())
    assert cal.optimizer_per_byte is not None and cal.optimizer_per_byte > 0
