"""Built-in workloads train in eager mode, large presets have their published sizes, and
user models load from ``path/to/file.py:factory`` in every accepted form."""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from chronotope.errors import ChronotopeError, ModelLoadError, UnknownModelError
from chronotope.models import BUILTINS, Workload, get_workload, load_workload

TINY = ["gpt", "llama", "bert", "t5", "swin", "evoformer"]
HF = ["hf-gpt2", "hf-llama", "hf-bert", "hf-t5"]
USER_FILE = Path(__file__).with_name("user_model.py")


pytestmark = pytest.mark.usefixtures("one_thread")


def loss_of(w: Workload) -> torch.Tensor:
    out = w.model(*w.inputs, **w.kwargs)
    if w.loss_fn is not None:
        return w.loss_fn(out, *w.targets)
    return out if isinstance(out, torch.Tensor) else out.loss


def check_trains(name: str) -> None:
    """Finite scalar loss, a finite gradient for every parameter, the same loss per seed."""
    w = get_workload(name)
    assert w.name == name
    loss = loss_of(w)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    for pname, p in w.model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {pname}"
        assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient for {pname}"
    assert torch.equal(loss_of(get_workload(name)).detach(), loss.detach())
    assert not torch.equal(loss_of(get_workload(name, seed=1)).detach(), loss.detach())


@pytest.mark.parametrize("name", TINY)
def test_tiny_builtins_train_and_repeat(name):
    check_trains(name)


@pytest.mark.parametrize("name", TINY)
def test_batch_size_sets_the_leading_dim(name):
    w = get_workload(name, batch_size=3)
    assert all(t.shape[0] == 3 for t in w.inputs)
    assert loss_of(w).dim() == 0


@pytest.mark.parametrize("name", HF)
def test_hf_builtins_train_and_repeat(name):
    pytest.importorskip("transformers")
    check_trains(name)


def test_hf_overrides_reach_the_config_and_typos_are_rejected():
    pytest.importorskip("transformers")
    w = get_workload("hf-llama", num_hidden_layers=1, batch_size=2)
    assert len(w.model.model.layers) == 1 and w.kwargs["input_ids"].shape == (2, 32)
    with pytest.raises(TypeError, match="num_hiden_layers"):
        get_workload("hf-llama", num_hiden_layers=1)


def test_hf_without_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"pip install chronotope\[hf\]"):
        get_workload("hf-gpt2")


@pytest.mark.parametrize(
    "name, expected, rel",
    [("gpt3-1.3b", 1.3e9, 0.02), ("gpt3-13b", 13e9, 0.02),
     ("gpt3-175b", 175e9, 0.01), ("llama-70b", 69e9, 0.02), ("llama3-70b", 70.6e9, 0.01)],
)
def test_large_presets_build_on_meta_with_their_published_size(name, expected, rel):
    w = get_workload(name, device="meta")
    assert all(p.is_meta for p in w.model.parameters())
    assert all(t.is_meta for t in w.inputs)
    assert sum(p.numel() for p in w.model.parameters()) == pytest.approx(expected, rel=rel)


def test_llama_70b_shape():
    from chronotope.models.llama import PRESETS

    c = PRESETS["llama-70b"]
    assert (c.n_layer, c.d_model, c.n_head, c.n_kv_head, c.d_ffn, c.vocab_size) == \
        (80, 8192, 64, 8, 28672, 32000)


def test_evoformer_batch_and_recycling():
    w = get_workload("evoformer")
    target_feat, msa_feat, bins = w.inputs
    assert target_feat.shape == (2, 8, 22) and msa_feat.shape == (2, 4, 8, 49)
    assert torch.equal(bins, bins.transpose(1, 2))
    assert not torch.equal(loss_of(w), loss_of(get_workload("evoformer", n_recycle=0)))


def test_evoformer_traces_with_plain_fx_and_recycling_stays_out_of_backward():
    """fx drops ``torch.no_grad``, so equal gradients show the detach alone does the job."""

    class Inline(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return False

    w = get_workload("evoformer", n_block=1, n_recycle=2)
    gm = fx.GraphModule(w.model, Inline().trace(w.model))
    params = dict(w.model.named_parameters())
    ref = loss_of(w)
    ref_grads = torch.autograd.grad(ref, list(params.values()))
    loss = gm(*w.inputs)  # the GraphModule shares the model's parameters
    grads = torch.autograd.grad(loss, list(params.values()))
    torch.testing.assert_close(loss, ref)
    for name, g, r in zip(params, grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, msg=name)


def test_unknown_name_lists_the_builtins_and_the_file_form():
    with pytest.raises(UnknownModelError) as info:
        get_workload("gtp")
    assert isinstance(info.value, KeyError)
    message = str(info.value)
    assert all(name in message for name in BUILTINS)
    assert "path/to/file.py:factory" in message and "did you mean 'gpt'" in message
    with pytest.raises(UnknownModelError, match="path/to/file.py:factory"):
        load_workload("no-such-model")


def test_unknown_preset_lists_the_presets():
    from chronotope.models.gpt import gpt

    with pytest.raises(UnknownModelError, match="gpt3-175b"):
        gpt(preset="gpt3-176b")


def test_load_workload_takes_builtin_names():
    w = load_workload("gpt", batch_size=2)
    assert w.name == "gpt" and w.inputs[0].shape[0] == 2


def test_load_plain_factory_with_a_tensor_input():
    path_before = list(sys.path)
    w = load_workload(f"{USER_FILE}:make")
    assert sys.path == path_before
    assert w.inputs[0].shape == (3, 4) and w.kwargs == {} and w.loss_fn is None
    assert w.name == "user_model.make"
    assert load_workload(f"{USER_FILE}:make", device="meta").model.fc1.weight.is_meta


def test_load_factory_taking_device_and_seed_with_tuple_inputs():
    w = load_workload(f"{USER_FILE}:make_args", seed=3)
    x, y = w.inputs
    assert loss_of(w).dim() == 0
    assert not torch.equal(load_workload(f"{USER_FILE}:make_args", seed=4).inputs[0], x)
    assert torch.equal(load_workload(f"{USER_FILE}:make_args", seed=3).inputs[0], x)


def test_load_factory_with_keyword_inputs():
    w = load_workload(f"{USER_FILE}:make_kwargs", batch_size=6)
    assert w.inputs == () and set(w.kwargs) == {"x", "y"}
    assert w.kwargs["x"].shape == (6, 4)
    assert loss_of(w).dim() == 0


def test_load_factory_with_a_loss_fn_keeps_its_own_default_batch():
    w = load_workload(f"{USER_FILE}:make_loss_fn")  # batch_size=None is not passed on
    assert w.inputs[0].shape == (5, 4) and w.loss_fn is not None
    assert loss_of(w).dim() == 0


def test_load_factory_returning_a_workload():
    w = load_workload(f"{USER_FILE}:make_workload", batch_size=4, device="meta")
    assert isinstance(w, Workload) and w.inputs[0].shape == (4, 4) and w.inputs[0].is_meta


def test_same_seed_same_model_from_a_file():
    a = load_workload(f"{USER_FILE}:make", seed=1).model.fc1.weight
    b = load_workload(f"{USER_FILE}:make", seed=1).model.fc1.weight
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ("{dir}/missing.py:make", r"no such file .*missing\.py"),
        ("{file}:nope", r"defines no 'nope'.*make_args"),
        ("{file}:NOT_A_FUNCTION", r"'NOT_A_FUNCTION' is a int, not a function"),
        ("{file}", r"names a file but no factory.*user_model\.py:factory"),
        ("{dir}/notes.txt:make", r"expected a Python file"),
        ("{file}:broken", r"user_model\.py:broken raised ValueError: no weights for this size"),
        ("{file}:wrong_type", r"wrong_type returned a int; expected a Workload, \(model, inputs\)"),
        ("{file}:wrong_model", r"returned a str as the model"),
        ("{file}:wrong_inputs", r"returned a float as inputs; .*a dict of keyword arguments"),
    ],
)
def test_bad_specs_say_what_is_expected(spec, pattern):
    spec = spec.format(dir=USER_FILE.parent, file=USER_FILE)
    with pytest.raises(ModelLoadError, match=pattern) as info:
        load_workload(spec)
    assert isinstance(info.value, ChronotopeError)


def test_import_errors_in_the_users_file_are_reported(tmp_path):
    bad = tmp_path / "bad_model.py"
    bad.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(ModelLoadError, match=r"importing .*bad_model\.py.* failed: "
                                             r"ModuleNotFoundError"):
        load_workload(f"{bad}:make")


def test_users_file_may_import_its_siblings(tmp_path):
    (tmp_path / "layers_xyz.py").write_text(
        "import torch\nclass Net(torch.nn.Module):\n"
        "    def forward(self, x):\n        return (x * x).sum()\n"
    )
    (tmp_path / "net.py").write_text(
        "import torch\nfrom layers_xyz import Net\n"
        "def build():\n    return Net(), torch.ones(2)\n"
    )
    w = load_workload(f"{tmp_path}/net.py:build")
    assert loss_of(w).item() == 2.0
    assert str(tmp_path) not in sys.path
    sys.modules.pop("layers_xyz", None)


def test_model_loss_forms_are_consistent():
    """A user loss_fn sees the raw model output."""
    w = load_workload(f"{USER_FILE}:make_loss_fn")
    out = w.model(*w.inputs)
    assert out.shape == (5, 1)
    assert torch.equal(loss_of(w), w.loss_fn(out))
    assert F.mse_loss(out, out).item() == 0.0


def test_gpt_attention_written_out_equals_the_fused_kernel_and_splits_by_heads():
    """``flash=False`` writes the scores out (as attention ran before fused kernels): the
    same loss as the fused call, and a tensor-parallel plan of it trains like one device."""
    import warnings

    import chronotope as ct
    from chronotope.runtime.local import Optim
    from chronotope.runtime.reference import train_reference
    from tests.policies.plan_testing import trains_like_one_device

    fused, written = (get_workload("gpt", flash=f) for f in (True, False))
    written.model.load_state_dict(fused.model.state_dict())
    losses = [train_reference(w, 2, Optim("sgd", 0.1)).losses for w in (fused, written)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(written)
    assert any(op.kind == "softmax" for op in graph)
    trains_like_one_device(written, ct.compile(ct.policies.mesh(graph, dp=2, tp=2)))
