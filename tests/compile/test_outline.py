"""Outlining: repeated stretches of generated code become one function, and run the same."""

import re
import warnings

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as hs

import chronotope as ct
from chronotope.compile.outline import Stretch, outline, roll, with_cheap
from chronotope.models import get_workload
from chronotope.policies import ParallelConfig, make


def flat(per_stretch: list[list[str]], functions: list[list[str]]
         ) -> tuple[list[str], list[list[str]]]:
    return [line for lines in per_stretch for line in lines], functions


def run(lines: list[str], functions: list[list[str]]) -> list:
    """What ``lines``, run as a function body with ``functions`` around, ask of the runtime,
    and what they leave unfreed."""
    source = "\n".join(["def body(rt):", *("    " + line for line in lines),
                        "    return sorted(locals())", *(line for f in functions for line in f)])
    scope: dict = {}
    exec(source, scope)
    rt = Recorder()
    left = scope["body"](rt)
    return [*rt.calls, ("left", left)]


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

    def step(self, *args):
        self.calls.append(("step", args))
        return len(self.calls)


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
    lines, functions = flat(*outline(stretches))
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
    lines, functions = flat(*outline(stretches))
    assert not functions and lines == [line for s in stretches for line in s.lines]


def test_a_cheap_load_is_made_by_the_function_not_passed():
    stretches = steps(4)
    cheap = {"w": "rt.load('w')"}
    lines, functions = flat(*outline(stretches, cheap))
    lines = with_cheap(lines, cheap)
    assert functions[0][0] == "def stage0_forward(rt, m, total):"
    assert "    w = rt.load('w')" in functions[0]
    assert "w = rt.load('w')" not in lines and not any(line.startswith("del w") for line in lines)
    plain = [line for s in stretches for line in s.lines]
    losses = [[c for c in run(code, f) if c[0] in ("loss", "left")] for code, f in
              ((lines, functions), (plain, []))]
    assert losses[0] == losses[1]  # (each call loads it again)
    assert "w" not in losses[0][-1][1]


@pytest.mark.slow
def test_a_folded_pipeline_writes_each_step_once():
    """gpt, 1F1B over 2 stages and 8 micro-batches, folded: each rank's code has one
    function per kind of step (it was written out 8 times), and its steady state is a
    loop over micro-batches that calls both, labelled with the steps it runs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(get_workload("gpt", batch_size=8))
    program = ct.compile(make(graph, ParallelConfig("1f1b", 2, micro=8)))
    for rank in range(2):
        code = program.code(rank)
        assert f"def stage{rank}_forward(rt, m" in code
        assert f"def stage{rank}_backward(rt, m" in code
        loop = re.search(r"\n    for m in range\((?:\d+, )?\d+\):  # steps .+\n((?:        .*\n)+)",
                         code)
        assert loop is not None
        assert f"stage{rank}_forward(rt, m" in loop.group(1)
        assert f"stage{rank}_backward(rt, m" in loop.group(1)
        assert code.count("rt.micro(") < 8  # of 16 steps: most are calls


@pytest.mark.parametrize("model, container, layers", [("gpt", "h", 4), ("llama", "layers", 4)])
def test_repeated_layers_become_one_function_called_per_layer(model, container, layers):
    """Each layer of the model's stack: one call of one function, its parameters named
    from the layer it is called for (``f'{at}.attn...'``); the forward and the gradients'
    hand-over each. The forward's calls, each handing the next layer its input, are one
    loop over the layers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(get_workload(model))
    code = ct.compile(make(graph, ParallelConfig("dp", 2))).code(0)
    for kind in ("forward", "grads"):
        assert f"def {container}_{kind}(rt, at" in code
        loop = re.search(rf"\n    for i in range\({layers}\):\n        .* = {container}_{kind}"
                         rf"\(rt, f'{container}.{{i}}'", code)
        assert loop is not None or kind != "forward"
        for layer in range(layers):
            assert loop or f"{container}_{kind}(rt, '{container}.{layer}'" in code
    assert "rt.param(f'{at}." in code
    assert len(code.splitlines()) < 450


def chain(passes: int, last_frees: str = "") -> list[str]:
    """A value handed from pass to pass (micro-batch m + 1, layer 'h.<m>'), read at the
    end; each pass frees what it read, the last ``last_frees`` too."""
    lines = ["w = rt.load('w')", "x_m0 = rt.step(0)"]
    for m in range(passes):
        lines += [f"x_m{m + 1} = rt.step({m + 1}, x_m{m}, w, 'h.{m}#1:{2 * m + 3}')  # step 0F{m}",
                  f"del x_m{m}" + (last_frees if m == passes - 1 else "")]
    return [*lines, f"rt.loss(x_m{passes})"]


def unrolled(lines: list[str]) -> list:
    """What ``lines`` ask of the runtime, and how many names they leave (loop counters
    aside: a loop's names may differ from the lines it was made of)."""
    *calls, (_, left) = run(lines, [])
    return [*calls, ("left", len([n for n in left if n not in ("i", "m", "_")]))]


@pytest.mark.parametrize("last_frees", ["", ", w"])
def test_passes_alike_up_to_what_they_hand_on_and_their_counters_become_a_loop(last_frees):
    lines = chain(6, last_frees)
    rolled = roll(lines)
    loop = [line for line in rolled if line.startswith("for ")]
    assert loop == ["for m in range(1, 7):  # steps 0F0 to 0F5"]
    body = rolled[rolled.index(loop[0]) + 1]
    assert body == "    x_m0 = rt.step(m, x_m0, w, f'h.{m - 1}#1:{2 * m + 1}')"
    assert rolled[-1] == "rt.loss(x_m0)"  # (what the loop hands on keeps its first name)
    assert unrolled(rolled) == unrolled(lines)
    assert len(rolled) < 8


def test_passes_that_would_read_another_passes_value_stay_written_out():
    lines = chain(5)
    lines[6] = "x_m3 = rt.step(3, x_m1, w, 'h.2#1:7')"  # reads two passes back
    assert roll(lines) == lines
    lines = chain(5)
    lines[-2:] = ["rt.loss(x_m4)"]  # read after: what the pass before the last made
    rolled = roll(lines)
    assert "for m in range(1, 5):  # steps 0F0 to 0F3" in rolled  # (the last: written out)
    assert unrolled(rolled) == unrolled(lines)
    lines = chain(5)
    lines[6] = lines[6].replace("'h.2#1:7'", "'h.2#1:8'")  # a number off its step
    assert not any(line.startswith("for ") for line in roll(lines))


@settings(max_examples=150, deadline=None)
@given(hs.data())
def test_rolled_lines_ask_the_runtime_what_the_lines_did(data):
    """Random passes that hand values on, read a shared value, count in numbers and in
    strings and free what they read, some passes changed at random (reading two passes
    back, a number off its step, a free left out) and some of their values read after:
    rolled, they ask the runtime the same things in the same order, and keep no more."""
    passes, width = data.draw(hs.integers(3, 6)), data.draw(hs.integers(1, 3))
    kinds = ["carried", "crossed", "shared", "made"]
    template = [(data.draw(hs.sampled_from(kinds if c else kinds[:3])),
                 data.draw(hs.sampled_from([1, 2, 0])), data.draw(hs.booleans()),
                 data.draw(hs.booleans())) for c in range(width)]
    lines = ["w = rt.load('w')", *(f"v{c}_0 = rt.step({c})" for c in range(width))]
    for m in range(1, passes + 1):
        for c, (kind, step, text, frees) in enumerate(template):
            number = step * m + 3
            if data.draw(hs.integers(0, 9)) == 0:  # a pass unlike the others
                kind = data.draw(hs.sampled_from([*kinds, "back2"]))
                number, frees = number + 1, not frees
            read = {"carried": f"v{c}_{m - 1}", "crossed": f"v{(c + 1) % width}_{m - 1}",
                    "shared": "w", "made": f"v{c - 1}_{m}", "back2": f"v{c}_{max(m - 2, 0)}"}
            lines.append(f"v{c}_{m} = rt.step({repr(f'h.{number}#1') if text else number}, "
                         f"{read[kind]})")
            if frees and kind in ("carried", "crossed"):
                lines.append(f"del {read[kind]}")
    after = data.draw(hs.lists(hs.integers(0, passes), max_size=2))
    lines += [f"rt.loss(v{c}_{m})" for m in after for c in range(width)]
    try:
        expected = unrolled(lines)
    except NameError:
        assume(False)
    *calls, (_, left) = unrolled(roll(lines))
    assert calls == expected[:-1]
    assert left <= expected[-1][1]  # (a value nothing reads again may go when its name does)


STATEMENTS = [  # the forms codegen writes, and forms it does not (read by the ast module)
    "x = 1", "x= f(a, b=2)", "a, b = f(c)", "(a, b) = g(x, y=z)", "a, = f(b)", "del a, b",
    "return a, b", "f(a)  # a comment 'q'", "x = 'a#b'  # z", "x = 1e-05 * y", "x = .5",
    "x = -3", "x = y.z(1, k='v')", "x = {'a': b}", "x = y[0:2, c:d]", "x = 'it\\'s'",
    "x = \"a'b\"", "rt.micro(3)", "x = f(a)[0]", "x = y <= z", "x = a != b", "x = None",
    "x = not y", "x = f(*a, **b)", "x = a @ b", "x = ~a", "# only a comment",
    "x = a if b else c", "x = rt.grad('h.0.w', ((0, 16), (8, 16)), d_w)",
    # not read by parts
    "x.a = 1", "x[0] = y", "a = b = c", "del a[0]", "x: int = 3", "if x: y", "f'{a}'", "b'x'",
    "x = 'a' 'b'", "x = 0x10", "y = lambda q: q", "y = [t for t in z]", "x += 1",
    "x = (a := 3)", "x = 1j", "x = 'é'",
]


@pytest.mark.parametrize("statement", STATEMENTS)
def test_reading_a_statement_by_its_parts_agrees_with_the_ast(statement):
    from chronotope.compile.outline import _parsed, _scanned, _statements

    read, = _statements([statement])
    parsed = _parsed([statement])
    for what in ("kind", "found", "end", "target", "uses", "defs", "made", "kills"):
        assert getattr(read, what) == getattr(parsed, what), what
    assert (_scanned(statement) is None) == (STATEMENTS.index(statement) >=
                                             STATEMENTS.index("x.a = 1"))


def test_every_generated_statement_is_read_by_its_parts_as_the_ast_reads_it():
    from chronotope.compile.outline import _parsed, _scanned

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(get_workload("gpt", batch_size=4))
        program = ct.compile(make(graph, ParallelConfig("dp-tp", 4, tp=2, pp=2, micro=2)))
    lines = set()
    for r in range(4):
        code = program.code(r).splitlines()
        lines |= {line.strip() for line, after in zip(code, code[1:]) if
                  line.startswith("    ") and not line.startswith("     ") and
                  not after.startswith("     ")}  # (a statement on one line)
    read = [line for line in lines if _scanned(line) is not None]
    written = {line for line in lines if "f'" not in line}  # f-strings: outlining's output
    assert len(read) > 0.9 * len(written)
    for line in read:
        scanned, parsed = _scanned(line), _parsed([line])
        assert scanned[:4] == (parsed.kind, parsed.found, parsed.end[1], parsed.target), line
        assert scanned[4:] == (parsed.uses, parsed.defs, parsed.kills), line
