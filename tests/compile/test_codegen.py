"""Generated rank code: public torch names, lines of a readable width, nothing copied for
nothing."""

import re
import warnings

import pytest

import chronotope as ct
from chronotope.compile.codegen import _wrap, render
from chronotope.models import get_workload
from chronotope.policies import mesh


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
