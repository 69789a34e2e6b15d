"""Capture: every model's training step becomes a Graph the reference executor reproduces."""

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.models import get_workload
from tests.graph.op_testing import assert_same_step

BUILTINS = ["gpt", "llama", "bert", "t5", "swin", "evoformer"]


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_models_capture_and_replay_exactly(name):
    w = get_workload(name)
    graph = ct.capture(w)
    assert graph.frontend == "fx"
    assert graph.unannotated_ops() == []
    assert graph.num_params == sum(p.numel() for p in w.model.parameters())
    assert_same_step(graph, w)


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama", "hf-bert", "hf-t5"])
def test_hugging_face_models_capture_and_replay_exactly(name):
    pytest.importorskip("transformers")
    w = get_workload(name)
    graph = ct.capture(w)
    assert graph.unannotated_ops() == []
    assert graph.num_params == sum(p.numel() for p in w.model.parameters())
    assert_same_step(graph, w)


@pytest.mark.parametrize("name", ["gpt", "t5"])
def test_export_frontend_gives_an_equivalent_graph(name):
    w = get_workload(name)
    graph = ct.capture(w, frontend="export")
    assert graph.frontend == "export"
    assert set(graph.params) == {n for n, _ in w.model.named_parameters()}
    assert_same_step(graph, w)


def test_dropout_replays_with_the_same_random_numbers():
    w = get_workload("gpt", dropout=0.1)
    assert_same_step(ct.capture(w), w)


def test_parameters_are_named_by_module_path_and_ops_keep_their_source():
    w = get_workload("gpt")
    graph = ct.capture(w)
    assert "h.0.attn.c_attn.weight" in graph.params
    assert [t.name for t in graph.inputs] == ["idx", "targets"]
    assert all(op.source is not None for op in graph)
    linear = next(op for op in graph if op.kind == "linear")
    assert linear.source.file.endswith("chronotope/models/gpt.py")
    assert linear.source.module == "h.0.attn.c_attn"
    text = str(graph)
    assert "linear(" in text and "b0 b1 k+, n k+, n -> b0 b1 n" in text and "gpt.py:" in text


class InPlace(nn.Module):
    """Writes its activations in place, as real models do."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask):
        y = self.proj(x) * 2
        y.add_(1.0)
        y[:, 0] = 0.0
        y = F.relu(y, inplace=True) * 1.5
        y.masked_fill_(mask, -1.0)
        z = torch.zeros_like(y)
        z.copy_(y)
        return (z * y).sum()


def test_inplace_updates_become_ssa():
    model = InPlace()
    x, mask = torch.randn(4, 8), torch.rand(4, 8) > 0.5
    graph = ct.capture(model, (x, mask))
    assert all(not (isinstance(op.target, str) and op.target.endswith("_")) for op in graph)
    produced = [t for op in graph for t in op.outputs]
    assert len(produced) == len(set(produced))  # every version is a new tensor
    assert graph.unannotated_ops() == []
    assert_same_step(graph, ct.Workload(model, (x, mask)))


class UpdatesParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        self.w.mul_(2.0)
        return (x * self.w).sum()


def test_updating_a_parameter_in_place_is_refused():
    with pytest.raises(ct.CaptureError, match="w"):
        ct.capture(UpdatesParameter(), torch.randn(4), frontend="fx")


def test_loss_fn_and_model_outputs():
    model, x, y = nn.Linear(4, 3), torch.randn(5, 4), torch.randint(0, 3, (5,))
    graph = ct.capture(model, x, F.cross_entropy, targets=(y,))
    assert [t.name for t in graph.inputs] == ["input", "target"]
    assert_same_step(graph, ct.Workload(model, (x,), targets=(y,), loss_fn=F.cross_entropy))

    class Returns(nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.kind, self.lin = kind, nn.Linear(4, 1)

        def forward(self, x):
            loss = self.lin(x).mean()
            return {"loss": loss, "aux": x} if self.kind == "dict" else (loss, x)

    for kind in ("dict", "tuple"):
        m = Returns(kind)
        assert_same_step(ct.capture(m, {"x": x}), ct.Workload(m, (), kwargs={"x": x}))
    with pytest.raises(ct.CaptureError, match="scalar"):
        ct.capture(model, x)


def test_unknown_ops_are_replicate_only_and_reported():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.atan(self.lin(x)).sum()

    model, x = Odd(), torch.randn(3, 4)
    with pytest.warns(UserWarning, match="atan"):
        graph = ct.capture(model, x)
    (op,) = graph.unannotated_ops()
    assert op.kind == "atan" and op.signature is None
    assert_same_step(graph, ct.Workload(model, (x,)))


@ct.register_op("b d, d -> b d")
def clipped_scale(x, w):
    """Reads a tensor value in Python: untraceable unless it is one registered op."""
    if x.abs().max() > 100:
        x = x.clamp(-100, 100)
    return x * w


class UsesCustomOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return clipped_scale(x, self.w).pow(2).sum()


def test_registered_user_op_is_one_annotated_node():
    model, x = UsesCustomOp(), torch.randn(3, 6)
    graph = ct.capture(model, x)
    (op,) = [op for op in graph if op.kind == "clipped_scale"]
    assert str(op.signature) == "b d, d -> b d" and op.signature.splittable() == ["b", "d"]
    assert_same_step(graph, ct.Workload(model, (x,)))


def test_registering_an_op_changes_no_shared_registry():
    from chronotope.graph import DEFAULT_REGISTRY

    known = dict(DEFAULT_REGISTRY._defs)
    ct.register_op("b d -> b d", name="shifted")(lambda x: x + 1)
    assert DEFAULT_REGISTRY._defs == known
    with pytest.raises(ct.SignatureError, match="frozen"):
        DEFAULT_REGISTRY.add([torch.atan], "atan", "... -> ...")


def test_plans_look_ops_up_in_the_registry_the_graph_was_captured_with():
    from chronotope.graph import DEFAULT_REGISTRY

    class Atan(nn.Module):
        def forward(self, x):
            return torch.atan(x).sum()

    registry = DEFAULT_REGISTRY.copy()
    registry.add([torch.atan, torch.ops.aten.atan], "atan", "b d -> b d")
    graph = ct.capture(Atan(), torch.randn(4, 4), registry=registry)
    assert graph.registry is registry and not graph.unannotated_ops()
    plan = ct.Plan(graph, 2)
    (atan,) = [op for op in graph if op.kind == "atan"]
    assert plan.registry is registry
    assert len(plan.trans(atan.name, ct.Split("b", 2))) == 2  # split by its signature


def test_bad_signature_strings_fail_at_registration():
    with pytest.raises(ct.SignatureError):
        ct.register_op("a b+ -> a b+")(lambda x: x)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.branchy = Branchy()

    def forward(self, x):
        return self.branchy(self.inner(x))


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # branch on a tensor value
            return x.sum()
        return x.mean()


def test_untraceable_model_names_module_line_and_what_to_try():
    line = inspect.getsourcelines(Branchy.forward)[1] + 1
    with pytest.raises(ct.CaptureError) as err:
        ct.capture(DataDependent(), torch.randn(2, 4))
    message = str(err.value)
    assert f"test_capture.py:{line}" in message and "(branchy)" in message
    assert "torch.export failed too" in message and "What to try" in message


def test_wrong_example_shapes_are_spelled_out():
    with pytest.raises(ct.CaptureError) as err:
        ct.capture(nn.Linear(8, 4), torch.randn(2, 5), lambda out: out.sum())
    message = str(err.value)
    assert "linear" in message and "float32[2, 5]" in message and "float32[4, 8]" in message
    assert "check the example inputs" in message


def test_executor_rejects_a_batch_of_another_shape():
    w = get_workload("gpt")
    graph = ct.capture(w)
    short = ct.Workload(w.model, (w.inputs[0][:2], w.inputs[1][:2]))
    with pytest.raises(ct.CaptureError, match=r"idx was captured as int64\[4, 32\]"):
        ct.execute(graph, short)


def test_meta_models_capture_without_weights():
    w = get_workload("gpt", device="meta")
    assert all(p.is_meta for p in w.model.parameters())
    graph = ct.capture(w)
    cpu_graph = ct.capture(get_workload("gpt"))
    assert [(op.kind, [t.meta for t in op.outputs]) for op in graph] == \
        [(op.kind, [t.meta for t in op.outputs]) for op in cpu_graph]


@pytest.mark.parametrize("name", ["gpt3-1.3b", "llama-70b"])
def test_large_presets_capture_on_meta(name):
    w = get_workload(name, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op may stay unannotated
        graph = ct.capture(w)
    assert graph.num_params == sum(p.numel() for p in w.model.parameters())
