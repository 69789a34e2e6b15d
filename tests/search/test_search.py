"""Automatic plan search: the ILP's plan is the optimum of its model, fits the memory limit
by the plan's own estimate, and trains like one device."""

import itertools
import json

import pytest
import torch
from search_testing import capture
from torch import nn

import chronotope as ct
from chronotope.cli import main
from chronotope.cost.network import cluster_for
from chronotope.models import get_workload
from chronotope.policies import data_parallel
from chronotope.runtime.launch import run_processes
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference
from chronotope.search import SearchError, search, zero_weights
from chronotope.search.build import build
from chronotope.search.ilp import price, solve
from chronotope.search.space import Mesh, meshes, repeated, strategies


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).square().mean()


@pytest.mark.parametrize("batch,width,hidden", [(64, 8, 16), (4, 64, 256), (16, 32, 32)])
@pytest.mark.parametrize("devices", [2, 4])
def test_the_ilp_finds_the_optimum_of_its_model_by_brute_force(batch, width, hidden, devices):
    graph = capture(ct.Workload(MLP(width, hidden), (torch.randn(batch, width),)))
    cluster = cluster_for(devices)
    space = strategies(graph, devices, cluster)
    ops = [op for op in graph.ops if space[op]]
    best = min(price(graph, dict(zip(ops, pick)), devices, cluster)
               for pick in itertools.product(*(space[op] for op in ops)))
    found = solve(graph, space, devices, cluster, None, gap=0)
    assert found.seconds == pytest.approx(best, rel=1e-6)
    assert price(graph, found.choice, devices, cluster) == pytest.approx(best, rel=1e-6)


class TiedEmbedding(nn.Module):
    """One weight read by two ops: the embedding and the output projection."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)

    def forward(self, idx):
        return nn.functional.linear(torch.tanh(self.emb(idx)), self.emb.weight).square().mean()


def test_a_weight_two_ops_read_is_read_by_both_in_one_layout():
    """Their gradients then add up where they are made and reduce once (priced once). Here
    a cut the projection's weight and a whole one for the embedding would be cheapest if
    each reader's gradient were reduced on its own; the ILP is still the optimum of its
    model."""
    w = ct.Workload(TiedEmbedding(32768, 64), (torch.randint(0, 32768, (4, 128)),))
    graph, cluster = capture(w), cluster_for(2)
    space = strategies(graph, 2, cluster)
    ops = [op for op in graph.ops if space[op]]
    best = min(price(graph, dict(zip(ops, pick)), 2, cluster)
               for pick in itertools.product(*(space[op] for op in ops)))
    found = solve(graph, space, 2, cluster, None, gap=0)
    assert found.seconds == pytest.approx(best, rel=1e-6)
    embedding, linear = (next(op for op in ops if op.name == n) for n in ("embedding", "linear"))
    assert found.choice[embedding].inputs[1] == found.choice[linear].inputs[1]


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_the_plan_found_trains_like_one_device_and_beats_the_ready_made_ones(model):
    w = get_workload(model)
    result = search(capture(w), 2)
    run = run_in_threads(ct.compile(result.plan), w, 2, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)
    assert sorted(c["plan"] for c in result.candidates) == [
        "dp", "searched (drec)", "searched (ilp)", "searched (mesh)", "tp"]
    assert result.predicted_step_s <= min(c["predicted_step_s"] for c in result.candidates)
    assert result.variables > 0 and result.search_s < 30


def test_a_memory_limit_is_met_by_the_plans_own_estimate_or_refused_naming_what_binds():
    graph = capture(get_workload("gpt"))
    free = search(graph, 2)
    limit = 0.93 * max(free.peak_memory_bytes)
    tight = search(graph, 2, memory=limit)
    assert max(tight.peak_memory_bytes) <= limit
    assert max(m.total for m in tight.plan.check().memory.values()) <= limit
    with pytest.raises(SearchError, match="weights, gradients and optimizer state .* at their "
                                          "best cut \\(the most: wte.weight"):
        search(graph, 2, memory=2 ** 20, method="ilp")
    with pytest.raises(SearchError, match="the least any point of the space needs is about "
                                          ".* MiB \\(dp \\d+ x tp \\d+ x pp \\d+, "
                                          ".* of it weights"):
        search(graph, 2, memory=2 ** 20)
    with pytest.raises(SearchError, match="unknown search method 'greedy'"):
        search(graph, 2, method="greedy")


@pytest.mark.slow
def test_a_searched_plan_trains_on_gloo_processes_like_one_device():
    w = get_workload("llama")
    result = search(capture(w), 2)
    run = run_processes(ct.compile(result.plan), w, 2, Optim("adamw", 1e-3))
    assert compare(run, train_reference(w, 2, Optim("adamw", 1e-3))).within(1e-5)


def test_the_command_line_searches_writes_the_plan_and_runs_it(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["search", "gpt", "--devices", "2", "--out", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"plan", "method", "predicted_step_s", "peak_memory_bytes",
                           "search_s", "variables", "candidates", "mesh", "explored", "timings",
                           "dtype", "simulated"}
    assert report["plan"] == str(path) and len(report["peak_memory_bytes"]) == 2
    assert main(["run", "gpt", "--plan", str(path), "--steps", "2", "--check", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["match"]
    assert main(["search", "gpt", "--devices", "2", "--memory", "0.001"]) == 2
    assert "no plan over 2 devices fits" in capsys.readouterr().err


def test_repeated_layers_share_one_decision_and_the_program_stays_small():
    graph = capture(get_workload("gpt", n_layer=4))
    cluster = cluster_for(2)
    space = strategies(graph, 2, cluster)
    groups = repeated(graph, space)
    assert groups and all(k[0].startswith("h.*") for k in groups.values())
    shared, alone = solve(graph, space, 2, cluster, None, groups=groups, gap=0), \
        solve(graph, space, 2, cluster, None, gap=0)
    assert shared.variables < alone.variables / 2
    assert shared.seconds == pytest.approx(alone.seconds, rel=1e-6)  # the layers agree anyway
    for key in set(groups.values()):  # one strategy per group
        assert len({shared.choice[op] for op, k in groups.items() if k == key}) == 1


def test_a_mesh_numbers_devices_row_major_and_groups_each_axis():
    mesh = Mesh((2, 4))
    assert mesh.groups(0) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert mesh.groups(1) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [str(m) for m in meshes(8)] == ["8", "4x2", "2x4"]
    assert [str(m) for m in meshes(64, per_node=8)] == ["64", "32x2", "16x4", "8x8"]
    assert [str(m) for m in meshes(12, per_node=8)] == ["12", "6x2", "3x4"]


class Regression(nn.Module):
    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, out)

    def forward(self, x):
        return self.proj(x).square().mean()


@pytest.mark.parametrize("batch,width,out", [(8, 4, 16), (2, 32, 8)])
def test_on_a_two_axis_mesh_the_ilp_finds_the_optimum_by_brute_force(batch, width, out):
    graph = capture(ct.Workload(Regression(width, out), (torch.randn(batch, width),)))
    mesh, cluster = Mesh((2, 2)), cluster_for(4, "dgx1-v100x2")
    space = strategies(graph, mesh, cluster)
    ops = [op for op in graph.ops if space[op]]
    assert all(len(s.algos) == 2 for op in ops for s in space[op])
    best = min(price(graph, dict(zip(ops, pick)), mesh, cluster)
               for pick in itertools.product(*(space[op] for op in ops)))
    found = solve(graph, space, mesh, cluster, None, gap=0)
    assert found.seconds == pytest.approx(best, rel=1e-6)


def test_a_plan_on_a_two_axis_mesh_trains_like_one_device():
    w = get_workload("llama")
    result = search(capture(w), 4, mesh=(2, 2))
    assert result.mesh == "2x2"
    assert any(" x " in label and "replicate x replicate" not in label
               for label in result.choices.values())
    run = run_in_threads(ct.compile(result.plan), w, 4, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 4, Optim("sgd", 0.1))).within(1e-5)
    with pytest.raises(SearchError, match="mesh 2x3 has 6 devices, not 4"):
        search(capture(w), 4, mesh=(2, 3))


class Wide(nn.Module):
    """Hidden features that do not halve: tensor parallelism has little room (none when
    ``features`` is odd too)."""

    def __init__(self, features: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(features, 255), nn.Linear(255, features)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x))).square().mean()


def test_when_memory_binds_the_search_cuts_more_and_trains_alike():
    w = ct.Workload(Wide(), (torch.randn(64, 64),))
    graph = capture(w)
    free = search(graph, 2)
    assert not free.plan.updates  # summing gradients in one call is cheaper
    dp = max(m.total for m in data_parallel(graph, 2).check().memory.values())
    tight = search(graph, 2, memory=0.9 * dp, mesh=(2,))
    assert max(tight.peak_memory_bytes) <= 0.9 * dp
    assert [c["fits"] for c in tight.candidates][0] and not tight.candidates[-2]["fits"]
    run = run_in_threads(ct.compile(tight.plan), w, 2, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 2, Optim("sgd", 0.1))).within(1e-5)


def test_where_only_the_batch_cuts_weight_updates_are_cut_to_fit_and_train_alike():
    w = ct.Workload(Wide(63), (torch.randn(64, 63),))
    graph, cluster = capture(w), cluster_for(2)
    space = strategies(graph, 2, cluster)
    dp = max(m.total for m in data_parallel(graph, 2).check().memory.values())
    assert not any(s.zero for s in solve(graph, space, 2, cluster, None).choice.values())
    tight = solve(graph, space, 2, cluster, 0.9 * dp)
    assert any(s.zero for s in tight.choice.values()) and tight.memory <= 0.9 * dp
    plan = build(graph, (2,), {op: s.algos for op, s in tight.choice.items()},
                 zero_weights(graph, tight.choice))
    assert plan.updates
    run = run_in_threads(ct.compile(plan), w, 2, Optim("adamw", 1e-3))
    assert compare(run, train_reference(w, 2, Optim("adamw", 1e-3))).within(1e-5)


def test_drec_pipelines_train_like_one_device_and_need_a_power_of_two():
    w = get_workload("llama", batch_size=8)
    graph = capture(w)
    result = search(graph, 4, method="drec")
    assert result.method == "drec" and "stages" in result.mesh  # its joint search's pick
    run = run_in_threads(ct.compile(result.plan), w, 4, Optim("sgd", 0.1))
    assert compare(run, train_reference(w, 4, Optim("sgd", 0.1))).within(1e-5)
    with pytest.raises(SearchError, match="power of two; got 6"):
        search(graph, 6, method="drec")


def test_without_simulating_the_ilp_plan_is_kept_by_the_search_model():
    """D-Rec's symbolic cost has no latency: it is not compared with the ILP's seconds."""
    result = search(capture(get_workload("gpt", batch_size=4)), 2, simulate=False)
    assert {c["plan"] for c in result.candidates} == {"searched (ilp)", "searched (mesh)"}
    assert not result.simulated and result.predicted_step_s == min(
        e["model_step_s"] for e in result.explored if e["model_step_s"] is not None)
    assert {"decide", "build", "check"} <= set(result.timings)
    assert result.search_s == result.timings["decide"]


def test_the_simulator_picks_among_the_cheapest_options_that_fit():
    result = search(capture(get_workload("gpt", batch_size=8)), 4, method="ilp")
    finals = [e for e in result.explored if "simulated_step_s" in e]
    assert len(finals) == 3
    assert result.predicted_step_s == min(e["simulated_step_s"] for e in finals)


def test_constraints_keep_the_cuts_they_allow_or_name_what_they_refuse(capsys):
    graph = capture(get_workload("gpt", batch_size=4))
    mlp = [op.name for op in graph.ops if op.source and ".mlp." in f"{op.source.module}."]
    result = search(graph, 2, method="ilp", constraints={"h.*.mlp*": "replicate"})
    assert mlp and all(result.choices[name] == "replicate" for name in mlp)
    with pytest.raises(SearchError, match="'nothing.*' matches no op or module"):
        search(graph, 2, constraints={"nothing.*": "replicate"})
    with pytest.raises(SearchError, match="leaves op .* no strategy; it has: "):
        search(graph, 2, method="ilp", constraints={"h.*.mlp*": "split q*"})
    with pytest.raises(SearchError, match=r"cannot keep to h.\* = replicate"):
        search(graph, 2, method="drec", constraints={"h.*": "replicate"})
    assert main(["search", "gpt", "--devices", "2", "--constrain", "lm_head=replicate",
                 "--method", "ilp", "--no-simulate", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "ilp"


def test_the_search_placements_are_dtensor_placements_of_the_pieces_a_plan_cuts():
    """Each strategy says per mesh axis how each tensor is held (R, P, S(dim)); as DTensor
    placements on the row-major mesh, they are the pieces op_trans cuts, device by device."""
    from chronotope.compile.rvd import Layout, placement
    from chronotope.graph.ops import DEFAULT_REGISTRY
    from chronotope.plan.algo import partition
    from chronotope.search.space import IRREGULAR

    graph = capture(get_workload("gpt", batch_size=4))
    mesh = Mesh((2, 2))
    whole = ct.Plan(graph, 1)
    space = strategies(graph, mesh, cluster_for(4), whole=whole)
    checked = set()
    for op, found in space.items():
        opdef = DEFAULT_REGISTRY.of(op.target)
        additive = opdef.additive_inputs if opdef is not None else ()
        linear = opdef.linear_in(len(op.inputs)) if opdef is not None else ()
        for s in found:
            pieces = [whole.roots[op.name].piece]
            for algo in s.algos:  # device i * 2 + j holds part j of part i
                pieces = [p for piece in pieces for p in
                          partition(op.name, op.signature, piece, algo, additive, linear)]
            root = whole.roots[op.name].piece
            held = [(s.inputs, [p.inputs for p in pieces], op.inputs, root.inputs),
                    (s.outputs, [p.outputs for p in pieces], op.outputs, root.outputs)]
            for codes, views, tensors, read in held:
                for k, (axes, t) in enumerate(zip(codes, tensors)):
                    if IRREGULAR in axes or read[k].mask.index != tuple((0, n) for n in t.shape):
                        continue  # (no placement; a region of the tensor, not all of it)
                    layout = Layout.from_placements(mesh.shape, tuple(map(placement, axes)),
                                                    (0, 1, 2, 3), len(t.shape))
                    assert sorted(layout.pieces(t.shape)) == [(d, v[k].mask) for d, v in
                                                              enumerate(views)], (op.name, s.label)
                    checked.add(axes)
    assert {("S(0)", "R"), ("R", "S(0)"), ("P", "R"), ("R", "R")} <= checked, checked
