"""Everyday PyTorch idioms keep their meaning through capture: custom autograd Functions,
grad-mode regions, in-place writes into views, parameters forward never uses, and state
that forward changes. Each category is a table of small models; each must capture (by
both frontends where both can) to a step equal to eager autograd's, and train equal to
one device under plans that split it."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.graph.verify import CaptureMismatch
from chronotope.runtime.local import run_in_threads
from tests.graph.op_testing import assert_same_step, trains_like_one_device

pytestmark = pytest.mark.usefixtures("one_thread")


def captured(model: nn.Module, *inputs: torch.Tensor, frontend: str = "auto") -> ct.Graph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(model, inputs, frontend=frontend)


class Stem(nn.Module):
    """``head(gelu(body(a(x))))`` and a mean-squared loss: ``body`` is the idiom."""

    def __init__(self, body, width: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, width), nn.Linear(width, 4)
        self.body = body

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.b(F.gelu(self.body(self.a(x), x))), y)


def workload(body) -> ct.Workload:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return ct.Workload(Stem(body), (torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)))


# ---- custom autograd Functions: one op, the user's own backward -----------------------------


class GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.alpha * g, None


class StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class ScaleBoth(torch.autograd.Function):
    """Two outputs and a saved tensor."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w, x.sum(-1, keepdim=True)

    @staticmethod
    def backward(ctx, ga, gb):
        x, w = ctx.saved_tensors
        return ga * w * 0.5 + gb, (ga * x).sum(0) * 2


@ct.register_op("b d -> b d")
class RowwiseClip(torch.autograd.Function):
    """Registered with a signature: its pieces split the batch, each running this
    forward and backward on its rows."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(-0.5, 0.5)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x.abs() < 0.5) + 0.1 * g


class WithParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, h, x):
        a, b = ScaleBoth.apply(h, self.w)
        return a + b


FUNCTIONS = {
    "gradient reversal": lambda h, x: GradReverse.apply(h, 0.5),
    "straight-through": lambda h, x: StraightThrough.apply(h),
    "two outputs, a parameter": WithParam(),
    "registered": lambda h, x: RowwiseClip.apply(h),
}


class Body(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, h, x):
        return self.fn(h, x)


def body(fn) -> nn.Module:
    return fn if isinstance(fn, nn.Module) else Body(fn)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_a_custom_function_is_one_op_with_its_own_backward(name):
    w = workload(body(FUNCTIONS[name]))
    graph = captured(w.model, *w.inputs, frontend="fx")
    functions = [op for op in graph if op.kind in ("GradReverse", "StraightThrough",
                                                   "ScaleBoth", "RowwiseClip")]
    assert len(functions) == 1 and not any(op.kind in ("round", "clamp") for op in graph)
    assert_same_step(graph, w)


def test_a_registered_function_splits_along_its_signature():
    w = workload(body(FUNCTIONS["registered"]))
    graph = captured(w.model, *w.inputs)
    (op,) = [op for op in graph if op.kind == "RowwiseClip"]
    assert op.signature is not None and graph.unannotated_ops() == []
    for policy in (lambda g: ct.policies.data_parallel(g, 2),
                   lambda g: ct.policies.pipeline(g, 2, 2, "1f1b")):
        trains_like_one_device(policy(graph), w)


SIGNED = {  # what each Function's forward lets split
    "gradient reversal": "s0 s1 -> s0 s1",
    "straight-through": "s0 s1 -> s0 s1",
    # the product's features meet a sum over them: only the batch splits
    "two outputs, a parameter": "s0 i0_1^, i1_0^ -> s0 o0_1^, s0 1",
}


@pytest.mark.parametrize("name", list(SIGNED))
def test_an_unregistered_function_splits_as_its_forward_does(name):
    w = workload(body(FUNCTIONS[name]))
    graph = captured(w.model, *w.inputs)
    (op,) = [op for op in graph if op.kind in ("GradReverse", "StraightThrough", "ScaleBoth")]
    assert str(op.signature) == SIGNED[name]
    for plan in (ct.policies.data_parallel(graph, 2), ct.policies.tensor_parallel(graph, 2),
                 ct.policies.pipeline(graph, 2, 2, "1f1b")):
        trains_like_one_device(plan, w)


class CentredGradient(torch.autograd.Function):
    """The identity forward, a backward that centres the gradient over the batch: its
    forward treats rows alone, its backward does not."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g - g.mean(0, keepdim=True)


def test_a_function_splits_only_where_its_own_backward_does():
    w = workload(body(lambda h, x: CentredGradient.apply(h)))
    graph = captured(w.model, *w.inputs)
    (op,) = [op for op in graph if op.kind == "CentredGradient"]
    assert op.signature.splittable() == ["s1"], str(op.signature)  # features, not the batch
    for plan in (ct.policies.data_parallel(graph, 2), ct.policies.tensor_parallel(graph, 2)):
        trains_like_one_device(plan, w)


def test_a_function_whose_forward_cannot_run_on_meta_runs_whole():
    class OnData(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * float(x.abs().max())  # reads a value: no meta tensor can

        @staticmethod
        def backward(ctx, g):
            return g

    w = workload(body(lambda h, x: OnData.apply(h)))
    graph = captured(w.model, *w.inputs)
    (op,) = [op for op in graph if op.kind == "OnData"]
    assert op.signature is None
    trains_like_one_device(ct.policies.data_parallel(graph, 2), w)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.reentrant = reentrant

    def forward(self, h, x):
        return torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_function_is_followed_into(reentrant):
    w = workload(Checkpointed(reentrant))
    graph = captured(w.model, *w.inputs, frontend="fx")
    assert {"linear", "tanh"} <= {op.kind for op in graph}
    assert_same_step(graph, w)


# ---- grad-mode regions ------------------------------------------------------------------


@torch.no_grad()
def centre(h):
    return h.mean(-1, keepdim=True)


def inference_statistic(h, x):
    with torch.inference_mode():
        s = (h * 2).std(-1, keepdim=True)
    return h / (s.clone() + 1)


def nested(h, x):
    with torch.no_grad():
        s = h.mean(0)
        with torch.enable_grad():
            t = h.pow(2).mean(0)  # reads h with grad again
    return h - s + t


def set_grad(h, x):
    with torch.set_grad_enabled(False):
        s = h.abs().amax(-1, keepdim=True)
    return h / (s + 1)


GRAD_MODES = {
    "no_grad block": lambda h, x: h - centre(h),
    "inference_mode": inference_statistic,
    "enable_grad inside no_grad": nested,
    "set_grad_enabled(False)": set_grad,
}


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("name", list(GRAD_MODES))
def test_what_runs_without_grad_passes_no_gradient(name, frontend):
    if frontend == "export" and name == "inference_mode":
        pytest.skip("torch.export does not trace inference_mode blocks")
    w = workload(body(GRAD_MODES[name]))
    graph = captured(w.model, *w.inputs, frontend=frontend)
    assert any(op.kind == "detach" for op in graph)
    assert_same_step(graph, w)


def test_capture_under_no_grad_still_captures_a_training_step():
    w = workload(body(lambda h, x: h * 2))
    with torch.no_grad():
        graph = captured(w.model, *w.inputs)
    assert not any(op.kind == "detach" for op in graph)
    assert_same_step(graph, w)


def test_a_no_grad_region_trains_like_one_device_under_plans():
    w = workload(body(GRAD_MODES["no_grad block"]))
    graph = captured(w.model, *w.inputs)
    for plan in (ct.policies.data_parallel(graph, 2), ct.policies.tensor_parallel(graph, 2),
                 ct.policies.pipeline(graph, 2, 2, "1f1b")):
        trains_like_one_device(plan, w)


# ---- in-place writes --------------------------------------------------------------------


def slice_add(h, x):
    h = h.clone()
    h[:, 0] += x[:, 0]
    return h


def copy_into_new_empty(h, x):
    z = h.new_empty(h.shape)
    z[..., :6].copy_(h[..., :6] * 2)
    z[..., 6:].copy_(h[..., 6:].tanh())
    return z


def activations_in_place(h, x):
    h = F.relu(h, inplace=True)
    h = h * 1
    h.mul_(2)
    h.masked_fill_(h > 3, 0.0)
    return h.clamp_(max=2.5)


def through_a_view_chain(h, x):
    h = h.clone()
    v = h.view(4, 2, 8)
    v[:, 0, :4].mul_(0.5)  # a box of a reshaped view
    h.t()[0] += 1  # a row of a transpose
    v.unsqueeze(0).add_(x.sum() * 0.01)  # all of it, through unsqueeze
    return h + v.reshape(4, 16) * 0.5  # v reads what h holds now


def index_put(h, x):
    h = h.clone()
    rows = torch.tensor([0, 2])
    h.index_put_((rows,), h[rows] * 3, accumulate=True)
    return h


def views_see_later_writes(h, x):
    h = h.clone()
    head = h[:, :8]  # made before the write below
    h.mul_(3)
    return torch.cat([head, h[:, 8:]], -1)


def no_grad_write(h, x):
    h = h * 1
    with torch.no_grad():  # autograd does not record it: the gradient passes through
        h[:, :3] = 0.0
        h.clamp_(-0.5, 0.5)
    return h


IN_PLACE = {
    "slice +=": slice_add,
    "copy_ into new_empty slices": copy_into_new_empty,
    "relu inplace, mul_, masked_fill_, clamp_": activations_in_place,
    "through views of views": through_a_view_chain,
    "index_put_": index_put,
    "views made before a write": views_see_later_writes,
    "under no_grad": no_grad_write,
}


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("name", list(IN_PLACE))
def test_in_place_writes_become_functional_with_eager_gradients(name, frontend):
    if frontend == "export" and name == "under no_grad":
        pytest.skip("a decomposed graph loses which writes autograd did not record")
    w = workload(body(IN_PLACE[name]))
    graph = captured(w.model, *w.inputs, frontend=frontend)
    assert all(not (isinstance(op.target, str) and op.target.endswith("_")) for op in graph)
    assert_same_step(graph, w)


@pytest.mark.parametrize("name", ["slice +=", "copy_ into new_empty slices",
                                  "through views of views"])
def test_in_place_writes_keep_the_batch_dim_splittable(name):
    w = workload(body(IN_PLACE[name]))
    graph = captured(w.model, *w.inputs)
    plan = ct.policies.data_parallel(graph, 2)
    assert not plan.unsplit, list(plan.unsplit)
    trains_like_one_device(plan, w)
    trains_like_one_device(ct.policies.pipeline(graph, 2, 2, "1f1b"), w)


# ---- parameters forward never uses ------------------------------------------------------


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 4)
        self.pooler = nn.Linear(4, 4)  # never called
        self.decoy = nn.Parameter(torch.ones(3))  # read, but the loss does not depend on it

    def forward(self, x, y):
        _ = self.decoy * 2
        return F.mse_loss(self.used(x), y)


@pytest.mark.parametrize("policy", ["dp", "tp", "zero-3", "1f1b"])
def test_unused_parameters_get_no_gradient_and_stay_as_they_are(policy):
    torch.manual_seed(0)
    w = ct.Workload(Unused(), (torch.randn(4, 8), torch.randn(4, 4)))
    graph = captured(w.model, *w.inputs)
    assert {"pooler.weight", "pooler.bias", "decoy"} <= set(graph.params)
    plan = {"dp": lambda: ct.policies.data_parallel(graph, 2),
            "tp": lambda: ct.policies.tensor_parallel(graph, 2),
            "zero-3": lambda: ct.policies.zero(graph, 2, 3),
            "1f1b": lambda: ct.policies.pipeline(graph, 2, 2, "1f1b")}[policy]()
    assert not {graph.params[n] for n in ("pooler.weight", "decoy")} & set(plan.grads)
    trains_like_one_device(plan, w)
    decayed = run_in_threads(ct.compile(plan), w, 2, ct.Optim("adamw", 0.1, weight_decay=0.1))
    for name in ("pooler.weight", "pooler.bias", "decoy"):  # weight decay leaves them alone too
        assert torch.equal(decayed.params[name], w.model.get_parameter(name).detach()), name


# ---- parameters read in slices -----------------------------------------------------------


class Sliced(nn.Module):
    """A position table longer than the sequence, read in part (``pos[:t]``), and a gated
    MLP whose gate and up projections are two halves of one weight (``w[:h]``, ``w[h:]``)."""

    def __init__(self, d: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(12, d))
        self.gate_up = nn.Parameter(torch.randn(2 * hidden, d) / d ** 0.5)
        self.down = nn.Linear(hidden, d)
        self.hidden = hidden

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x + self.pos[: x.shape[1]]
        gate, up = self.gate_up[: self.hidden], self.gate_up[self.hidden:]
        out = self.down(F.silu(x @ gate.t()) * (x @ up.t()))
        return F.mse_loss(out, y)


def sliced() -> ct.Workload:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return ct.Workload(Sliced(), (torch.randn(4, 6, 8, generator=g),
                                  torch.randn(4, 6, 8, generator=g)), name="sliced")


@pytest.mark.parametrize("policy", ["dp", "tp", "zero-3"])
def test_a_parameter_read_in_slices_keeps_every_part_and_trains_like_one_device(policy):
    """Slices that read all of a parameter between them each read their own part, so a
    plan keeps each device's part alone; a parameter read only in part is read whole, so
    that its unread rows are kept and updated (weight decay) as on one device."""
    w = sliced()
    graph = captured(w.model, *w.inputs)
    reads = sorted((op.inputs[0].name, op.region) for op in graph.ops
                   if op.kind == "getitem" and op.inputs[0].name in ("pos", "gate_up"))
    assert reads == [("gate_up", ((0, 16), (0, 8))), ("gate_up", ((16, 32), (0, 8))),
                     ("pos", None)]
    plan = {"dp": lambda: ct.policies.data_parallel(graph, 2),
            "tp": lambda: ct.policies.tensor_parallel(graph, 2),
            "zero-3": lambda: ct.policies.zero(graph, 2, 3)}[policy]()
    stored = plan.check().storage.stored
    held = [sum(m.numel for m in stored[d]["gate_up"]) for d in (0, 1)]
    assert held == [256 // 2, 256 // 2] if policy == "tp" else [256, 256], held
    trains_like_one_device(plan, w)
    decayed = run_in_threads(ct.compile(plan), w, 2, ct.Optim("adamw", 0.1, weight_decay=0.1))
    reference = ct.runtime.reference.train_reference(w, 2, ct.Optim("adamw", 0.1,
                                                                    weight_decay=0.1))
    assert ct.runtime.reference.compare(decayed, reference).within(1e-5)


# ---- state forward changes --------------------------------------------------------------


class Stateful(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x, y):
        out = self.lin(x)
        self.steps += 1  # a counter, reassigned
        with torch.no_grad():
            self.ema.mul_(0.9).add_(out.mean(0), alpha=0.1)  # updated in place
        self.scale = self.scale * 0.5 + 0.25  # reassigned
        return F.mse_loss(out * self.scale, y)


def test_buffers_forward_changes_are_updated_as_on_one_device():
    torch.manual_seed(0)
    w = ct.Workload(Stateful(), (torch.randn(4, 8), torch.randn(4, 4)))
    graph = captured(w.model, *w.inputs)
    assert set(graph.buffer_updates) == {"steps", "ema", "scale"}
    assert type(w.model.steps) is torch.Tensor and int(w.model.steps) == 0  # as it was
    assert_same_step(graph, w)
    for plan in (ct.policies.data_parallel(graph, 2), ct.policies.tensor_parallel(graph, 2),
                 ct.policies.zero(graph, 2, 3)):
        trains_like_one_device(plan, w)


def test_python_state_forward_changes_is_refused_by_name():
    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x).sum()

    model = Counts()
    with pytest.raises(ct.CaptureError, match="calls from 0 to 1.*register_buffer"):
        ct.capture(model, torch.randn(2, 8))
    assert model.calls == 0


def test_a_buffer_replaced_by_another_shape_is_refused_by_name():
    class Grows(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)
            self.register_buffer("seen", torch.zeros(0, 4))

        def forward(self, x):
            out = self.lin(x)
            self.seen = torch.cat([self.seen, out.detach()])
            return out.sum()

    with pytest.raises(ct.CaptureError, match="buffer seen"):
        ct.capture(Grows(), torch.randn(2, 8))


# ---- capture's self-check ---------------------------------------------------------------


def test_a_capture_that_differs_from_eager_is_an_error_naming_the_ops():
    # torch.export inlines a Function's forward and drops its backward: the check finds it
    w = workload(body(FUNCTIONS["gradient reversal"]))
    with pytest.raises(CaptureMismatch, match=r"a\.weight.*\n.*first op.*idioms\.py"):
        captured(w.model, *w.inputs, frontend="export")
    graph = ct.capture(w, frontend="export", check_up_to=0)  # the check turned off
    assert graph.frontend == "export"


def test_the_self_check_leaves_model_gradients_buffers_and_random_state_alone():
    torch.manual_seed(0)
    w = ct.Workload(Stateful(), (torch.randn(4, 8), torch.randn(4, 4)))
    w.model.lin.weight.grad = torch.full_like(w.model.lin.weight, 7.0)
    state = torch.random.get_rng_state()
    ct.capture(w)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(w.model.lin.weight.grad, torch.full_like(w.model.lin.weight, 7.0))
    assert int(w.model.steps) == 0 and not w.model.ema.any()


def test_the_self_check_skips_models_on_the_meta_device():
    with torch.device("meta"):
        model = Stem(body(lambda h, x: h))
    graph = ct.capture(model, (torch.randn(4, 8, device="meta"), torch.randn(4, 4, device="meta")))
    assert len(graph.ops) > 0
