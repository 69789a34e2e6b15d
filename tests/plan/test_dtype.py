"""A plan's dtype: what its memory estimate holds, what the simulator prices, what its file
records and what ``run --plan`` computes in."""

import json
import warnings

import pytest
import torch

import chronotope as ct
from chronotope.cli import main
from chronotope.compile.simulate import simulate
from chronotope.cost.network import cluster_for
from chronotope.errors import PlanError
from chronotope.graph.autocast import autocast_dtypes, casts
from chronotope.models import get_workload
from chronotope.plan.files import load_plan


def capture(name="gpt", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ct.capture(get_workload(name, device="meta", **kw), check_up_to=0)


def test_autocast_lowers_linears_and_keeps_norms_in_fp32():
    graph = capture()
    dtypes = autocast_dtypes(graph, "bf16")
    kinds = {op.kind: dtypes[op.outputs[0]] for op in graph.ops}
    assert kinds["linear"] == torch.bfloat16 and kinds["layer_norm"] == torch.float32
    assert all(casts(op, dtypes) for op in graph.ops if op.kind == "linear")
    assert not any(casts(op, dtypes) for op in graph.ops if op.kind == "layer_norm")
    assert autocast_dtypes(graph, "bf16") is dtypes  # inferred once per graph


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_16_bit_activations_shrink_the_estimate_and_weights_stay_fp32(low):
    # a small vocabulary: the loss, which autocast computes in fp32, would be the peak
    graph = capture("gpt3-1.3b", batch_size=2, n_layer=2, vocab_size=512)
    full = ct.policies.mesh(graph, tp=2).check().memory[0]
    plan = ct.policies.mesh(graph, tp=2)
    plan.dtype = low
    half = plan.check().memory[0]
    assert (half.params, half.grads, half.optimizer) == (full.params, full.grads, full.optimizer)
    # linears' outputs and gradients in 16 bits, the residual stream and norms in 32; each
    # linear keeps a 16-bit copy of its weight slice for the backward
    assert 0.5 * full.activations < half.activations < 0.85 * full.activations


def test_a_16_bit_plan_is_priced_at_the_tensor_core_rate():
    graph = capture("gpt3-1.3b", batch_size=8, n_layer=2)
    cluster = cluster_for(8, "dgx-a100")
    times = {}
    for dtype in ("fp32", "bf16"):
        plan = ct.policies.mesh(graph, dp=2, tp=4)
        plan.dtype = dtype
        times[dtype] = simulate(ct.compile(plan, cluster=cluster), cluster).step_time
    assert times["bf16"] < times["fp32"] / 4  # 312 against 19.5 TFLOP/s, the same messages


def test_an_unknown_dtype_is_refused():
    plan = ct.policies.mesh(capture(), dp=2)
    with pytest.raises(PlanError, match="unknown plan dtype 'int8'.*fp32, bf16, fp16"):
        plan.dtype = "int8"


def test_a_plan_file_records_its_dtype_and_run_computes_in_it(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--devices", "2", "--dtype", "bf16",
                 "--save-plan", str(path)]) == 0
    assert json.loads(path.read_text())["dtype"] == "bf16"
    assert load_plan(capture(), str(path)).dtype == "bf16"
    capsys.readouterr()
    assert main(["run", "gpt", "--plan", str(path), "--steps", "2", "--check", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["match"] and report["dtype"] == "bf16"
    assert main(["run", "gpt", "--plan", str(path), "--dtype", "fp32", "--steps", "1",
                 "--check", "--json"]) == 0  # the command line overrides the file
    assert json.loads(capsys.readouterr().out)["dtype"] == "fp32"
