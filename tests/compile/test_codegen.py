"""Generated rank code: public torch names, lines of a readable width, nothing copied for
nothing."""

import re
import warnings

import pytest

import chronotope as ct
from chronotope.compile.codegen import _wrap, render
from chronotope.compile.program import Forward
from chronotope.models import get_workload
from chronotope.policies import actions, mesh


@pytest.mark.parametrize("model", ["gpt", "llama", "swin"])
@pytest.mark.parametrize("policy", [{"dp": 2}, {"tp": 2}])
def test_generated_code_is_public_and_narrow(model, policy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(get_workload(model))
    program = ct.compile(mesh(graph, **policy))
    for rank in range(program.ndevices):
        code = render(program, rank)
        compile(code, f"rank{rank}", "exec")
        assert "torch._C" not in code  # F.linear, F.gelu, F.scaled_dot_product_attention
        assert max(map(len, code.splitlines())) <= 100
        # a rank that updates a whole parameter hands over its whole gradient, unsliced
        for name, region, var in re.findall(r"rt\.grad\('([^']+)', (\(.*?\),\)), (\S+)\)", code):
            whole = tuple((0, n) for n in graph.params[name].shape)
            if eval(region) == whole:
                assert "[" not in var, (name, var)


def test_wrap_keeps_what_a_line_means():
    names = [f"grad_block_{i}_weight" for i in range(12)]
    lines = [
        f"    {', '.join(names)} = f({', '.join(repr(f'x, {i}') for i in range(12))})",
        f"    {names[0]}, = f({'(, ' * 20!r}, {', )' * 20!r})",
        f"    del {', '.join(names)}",
        "    # " + " ".join(["word"] * 40),
    ]
    for line in lines:
        wrapped = _wrap(line)
        assert all(len(w) <= 100 for w in wrapped) and len(wrapped) > 1

    def run(source):
        scope = {"f": lambda *args: args[:12] if len(args) > 2 else (args,)}
        exec("def body():\n" + source + "\n    return locals()\nout = body()", scope)
        return scope["out"]

    for line in lines[:2]:
        assert run(line) == run("\n".join(_wrap(line)))
    left = run(lines[0] + "\n" + "\n".join(_wrap(lines[2])))  # del deletes them all
    assert not set(names) & set(left)


def test_a_local_name_never_reads_as_another_ops():
    """A second piece of ``linear`` is ``linear_p1``, not ``linear_1`` (another op's name)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(get_workload("gpt"))
    ops = {op.name: op for op in graph.ops}
    for plan in (mesh(graph, tp=2), mesh(graph, dp=2, micro=2), mesh(graph, coshard=2)):
        program = ct.compile(plan)
        for code in program.ranks:
            for ins in code:
                if isinstance(ins, Forward):
                    assert all(ops.get(v, ins.op.op) is ins.op.op for v in ins.outs), ins
    assert "linear_p1 = torch.nn.functional.linear(" in ct.compile(mesh(graph, tp=2)).code(0)


def schedule(code: str) -> list[str]:
    """The steps ``code`` runs, in order, read from its labels: ``# step 1F0`` on a step,
    ``# steps 1W1, 1F3 to 1W2, 1F4`` on a loop (its first and last passes)."""
    out = []
    for line in code.splitlines():
        if (loop := re.search(r"for \w+ in range\((-?\d+)(?:, (-?\d+))?(?:, (-?\d+))?\):  "
                              r"# steps (.+) to (.+)", line)):
            start, end = (int(loop[1]), int(loop[2])) if loop[2] else (0, int(loop[1]))
            by = int(loop[3] or 1)
            passes = len(range(start, end, by))
            first, last = (re.findall(r"(\d+[FBIW])(\d+)", loop[k]) for k in (4, 5))
            out += [f"{kind}{int(m) + k * (int(n) - int(m)) // (passes - 1)}"
                    for k in range(passes) for (kind, m), (_, n) in zip(first, last)]
        else:
            out += re.findall(r"# step (\S+)", line)
    return out


def test_a_folded_programs_code_shows_its_schedule():
    """Each step of the schedule is a labelled block of the code, or a labelled loop over
    alike steps, in the order it runs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(get_workload("gpt", batch_size=8))
    plan = ct.policies.pipeline(graph, 2, 4, "zb1", fold=True)
    program = ct.compile(plan)
    for rank, steps in actions(plan).items():
        assert schedule(program.code(rank)) == steps


@pytest.mark.parametrize("schedule_name, fold", [("1f1b", True), ("zb1", True), ("1f1b", False)])
def test_a_message_is_posted_between_calls_so_each_step_is_one_function(schedule_name, fold):
    """A receive posted ahead of a step (or, cut, of a layer) is posted before its call,
    not inside it: a stage's step and a layer run the same code whether or not a message
    is posted while they run, so every step of a folded schedule is one call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(get_workload("gpt", batch_size=8))
    plan = ct.policies.pipeline(graph, 2, 8, schedule_name, fold=fold)
    program = ct.compile(plan)
    for rank in range(program.ndevices):
        code = program.code(rank)
        functions = {text[:text.index("(")]: text for text in code.split("\n\n\ndef ")[1:]}
        posting = [name for name, body in functions.items()
                   if re.search(r"_pending = rt\.recv\(", body)]
        assert posting == ["step"], (rank, posting)  # messages are posted, by the step
        if fold:
            assert not re.search(r"^    # step ", code, flags=re.M), (rank, code)  # all calls
            assert schedule(code) == actions(plan)[rank]
