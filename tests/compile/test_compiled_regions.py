"""Forward regions for ``--compile``: what a region may hold, and that compiled regions
train like one device."""

import shutil
import warnings

import pytest

import chronotope as ct
from chronotope.compile.compiled_regions import (
    MIN_PIECES,
    Region,
    compilable,
    compiled_regions,
    entered,
)
from chronotope.compile.program import Backward, Forward, writes
from chronotope.models import get_workload
from chronotope.runtime.launch import run_processes
from chronotope.runtime.local import Optim, rank_specs
from chronotope.runtime.reference import compare, train_reference


def _workload(name: str = "gpt", **overrides) -> tuple:
    w = get_workload(name, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return w, ct.capture(w)


PLANS = {
    "dp": lambda g: ct.policies.data_parallel(g, 2),
    "tp-sequence": lambda g: ct.policies.mesh(g, tp=2, sequence=True),
    "1f1b-recompute": lambda g: ct.policies.mesh(g, tp=2, pp=2, micro=2, schedule="1f1b",
                                                 recompute="full"),
    "zb1": lambda g: ct.policies.mesh(g, pp=2, micro=2, schedule="zb1"),
    "zero-3": lambda g: ct.policies.zero(g, 2, 3),
}


@pytest.mark.parametrize("plan", PLANS)
def test_a_region_is_one_autograd_node_with_its_leaves_made_outside(plan):
    w, graph = _workload(dropout=0.1)
    program = ct.compile(PLANS[plan](graph))
    found = 0
    for rank, code in enumerate(program.ranks):
        items = compiled_regions(code)
        # grouping moves nothing: the instructions stay as they were, in order
        assert [x for i in items for x in (i.taken if isinstance(i, Region) else [i])] == code
        backward_of = {op.forward.name: k for k, ins in enumerate(code)
                       if isinstance(ins, Backward) for op in ins.ops}
        for region in (i for i in items if isinstance(i, Region)):
            found += 1
            pieces = region.pieces()
            assert len(pieces) >= MIN_PIECES and all(compilable(p) for p in pieces)
            # the compiled node's backward runs once: in one call for all its pieces
            assert len({backward_of.get(p.op.name) for p in pieces} - {None}) <= 1
            made: set[str] = set()
            for ins in region.body:
                if isinstance(ins, Forward):  # each leaf exists before the region starts
                    assert not {ins.ins[i] for i in entered(ins)} & made, ins.op.name
                made.update(writes(ins))
        # random pieces draw eagerly (their stream is the runtime's), outside any region
        drawn = {ins.op.name for ins in code if isinstance(ins, Forward) and not compilable(ins)}
        inside = {p.op.name for i in items if isinstance(i, Region) for p in i.pieces()}
        assert not drawn & inside
        text = program.code(rank, regions=True)
        compile(text, f"rank{rank}", "exec")  # valid Python
        assert text.count("\ndef forward_") == sum(isinstance(i, Region) for i in items)
    assert found


@pytest.mark.parametrize("plan", ["dp", "1f1b-recompute"])
def test_compiled_regions_train_like_one_device(plan):
    """AOTAutograd's graphs (aot_eager: what inductor compiles, run without codegen) in place
    of each region, their backward inside the fused backward calls: as one device."""
    w, graph = _workload(dropout=0.1 if plan == "dp" else 0.0)
    program = ct.compile(PLANS[plan](graph))
    result = run_processes(program, w, 2, Optim("sgd", 0.1), compile="aot_eager")
    assert compare(result, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on CPU builds C++ kernels")
def test_inductor_regions_train_like_one_device():
    w, graph = _workload(n_layer=1)
    program = ct.compile(ct.policies.data_parallel(graph, 1))
    result = run_processes(program, w, 2, Optim("sgd", 0.1), compile="inductor")
    assert compare(result, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on CPU builds C++ kernels")
def test_inductor_regions_that_return_views_of_one_intermediate_train_like_one_device():
    """Context parallelism cuts the logits into each sample's chunks for the token loss:
    a region returns several views of one intermediate, which a warm AOTAutograd cache
    (the other rank's compile) gave back with garbage sizes."""
    w, graph = _workload(n_layer=1)
    program = ct.compile(ct.policies.mesh(graph, cp=2))
    result = run_processes(program, w, 2, Optim("sgd", 0.1), compile="inductor")
    assert compare(result, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)


def test_an_unknown_backend_is_refused_with_the_ones_there_are():
    w, graph = _workload()
    program = ct.compile(ct.policies.data_parallel(graph, 2))
    with pytest.raises(ct.ChronotopeError, match="no backend 'nope'.*inductor"):
        rank_specs(program, w, compile="nope")
