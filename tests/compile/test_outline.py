"""Outlining: repeated stretches of generated code become one function, and run the same."""

import warnings

import pytest

import chronotope as ct
from chronotope.compile.outline import Stretch, outline
from chronotope.models import get_workload
from chronotope.policies import ParallelConfig, make


def run(lines: list[str], functions: list[list[str]]) -> list:
    """What ``lines``, run as a function body with ``functions`` around, ask of the runtime."""
    source = "\n".join(["def body(rt):", *("    " + line for line in lines),
                        *(line for f in functions for line in f)])
    scope: dict = {}
    exec(source, scope)
    rt = Recorder()
    scope["body"](rt)
    return rt.calls


class Recorder:
    """A stand-in for the runtime: it records what it is asked, in order."""

    def __init__(self) -> None:
        self.calls: list = []

    def micro(self, m):
        self.calls.append(("micro", m))

    def load(self, name):
        self.calls.append(("load", name))
        return len(name)

    def loss(self, value):
        self.calls.append(("loss", value))


def steps(count: int, last_extra: bool = False) -> list[Stretch]:
    """A once-a-step stretch, then ``count`` micro-batch steps alike up to their names
    and numbers (micro-batch m reads rows 2m to 2m + 2); the last frees what the others
    read, and with ``last_extra`` does one more thing at its end."""
    out = [Stretch(["w = rt.load('w')", "total = 0"], None)]
    for m in range(count):
        s = f"_m{m}" if m else ""
        lines = [f"rt.micro({m})", f"x{s} = w * {2 * m} + {2 * m + 2}", f"y{s} = x{s} + total",
                 f"del x{s}", f"total = y{s} + {m}", f"del y{s}"]
        if m == count - 1:
            lines[3] = f"del w, x{s}"
            if last_extra:
                lines.append("after = total * 3")
        out.append(Stretch(lines, "stage0_forward"))
    return [*out, Stretch(["rt.loss(total)", *(["rt.loss(after)"] * last_extra)], None)]


@pytest.mark.parametrize("last_extra", [False, True])
def test_repeated_steps_become_one_function_and_run_the_same(last_extra):
    stretches = steps(5, last_extra)
    plain = [line for s in stretches for line in s.lines]
    lines, functions = outline(stretches)
    assert len(functions) == 1
    function = "\n".join(functions[0])
    assert function.startswith("def stage0_forward(rt, m, w, total):")
    assert "rt.micro(m)" in function and "x = w * 2 * m + 2 * m + 2" in function
    assert sum(line.startswith("total = stage0_forward(rt, ") for line in lines) == 5
    # the last step's free of what every step reads, by the caller
    assert any(line.startswith("del w") for line in lines)
    assert run(lines, functions) == run(plain, [])


def test_stretches_that_differ_are_left_as_they_are():
    stretches = steps(2)
    stretches[2].lines[2] = "y_m1 = x_m1 - total"  # another operation
    lines, functions = outline(stretches)
    assert not functions and lines == [line for s in stretches for line in s.lines]


def test_a_cheap_load_is_made_by_the_function_not_passed():
    stretches = steps(4)
    cheap = {"w": "w = rt.load('w')"}
    lines, functions = outline(stretches, cheap)
    assert functions[0][0] == "def stage0_forward(rt, m, total):"
    assert "    w = rt.load('w')" in functions[0]
    assert not any(line.startswith("w = ") or line.startswith("del w") for line in lines)
    plain = [line for s in stretches for line in s.lines]
    losses = [[c for c in run(code, f) if c[0] == "loss"] for code, f in
              ((lines, functions), (plain, []))]
    assert losses[0] == losses[1]  # (each call loads it again)


@pytest.mark.slow
def test_a_folded_pipeline_writes_each_step_once():
    """gpt, 1F1B over 2 stages and 8 micro-batches, folded: each rank's code has one
    function per kind of step, called once per micro-batch (it was written out 8 times)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(get_workload("gpt", batch_size=8))
    program = ct.compile(make(graph, ParallelConfig("1f1b", 2, micro=8)))
    for rank in range(2):
        code = program.code(rank)
        assert f"def stage{rank}_forward(rt, m" in code
        assert f"def stage{rank}_backward(rt, m" in code
        calls = sum(f"stage{rank}_forward(rt, " in line and "def " not in line
                    for line in code.splitlines())
        assert calls >= 6
        assert code.count("rt.micro(") < 8  # of 16 steps: most are calls
