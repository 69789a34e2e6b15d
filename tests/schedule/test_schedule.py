"""The module schedule language: each primitive lowers to the plan primitives, trains like
one device, and is refused with the module and the fix named where it cannot apply."""

import math
import warnings

import pytest
import torch
from torch import nn

import chronotope as ct
from chronotope.models import get_workload
from chronotope.policies import tensor_parallel
from chronotope.policies.mesh import TpSplit
from chronotope.schedule.lower import analyse


@pytest.fixture(scope="module")
def gpt():
    workload = get_workload("gpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return workload, ct.capture(workload)


def fresh(gpt, devices=2) -> ct.Schedule:
    workload, graph = gpt
    return ct.schedule(workload, devices=devices, graph=graph)


def megatron(sch: ct.Schedule, sync=True, blocks=range(4)) -> ct.Schedule:
    for i in blocks:
        b = sch[f"h.{i}"]
        for column, row in (("attn.c_attn", "attn.c_proj"), ("mlp.c_fc", "mlp.c_proj")):
            b[column].shard(["weight", "bias"], axis=0)
            b[row].shard("weight", axis=1)
            if sync:
                b[row].sync(mode="fwd_post", op="all_reduce")
    return sch


def matches(sch: ct.Schedule, steps: int = 2) -> None:
    result = sch.verify(steps=steps)
    assert result.within(1e-5), str(result)


# ---- the tree ---------------------------------------------------------------------------

def test_sub_schedules_mirror_the_module_tree_and_own_their_ops(gpt):
    sch = fresh(gpt)
    attn = sch["h.0"]["attn"]
    assert attn.path == "h.0.attn" and attn.module is gpt[0].model.h[0].attn
    assert attn.modules() == ["c_attn", "c_proj", "resid_drop"]
    assert {op.source.module for op in attn.ops()} <= {"h.0.attn", "h.0.attn.c_attn",
                                                       "h.0.attn.c_proj"}
    assert "h.0.attn" in sch.modules() and sch.ops() == gpt[1].ops
    with pytest.raises(ct.ScheduleError, match=r"no module 'h.0.atn'; did you mean h.0.attn"):
        sch["h.0.atn"]


# ---- shard and sync ---------------------------------------------------------------------

def test_shard_cuts_columns_then_follows_the_heads_to_the_row_linear(gpt):
    layout, tp, pp = analyse(gpt[1], megatron(fresh(gpt))._state.steps)
    assert (tp, pp) == (2, 1)
    splits = {op.name: layout.splits.get(op) for op in gpt[1].ops}
    assert splits["linear"] == TpSplit("n", 3)  # q, k, v side by side: each cut in two
    assert splits["scaled_dot_product_attention"] == TpSplit("b1")  # the heads
    assert splits["linear_1"] == TpSplit("k")  # row: partial sums
    assert splits["add_1"] is None and splits["layer_norm"] is None  # after the sync: whole


def test_megatron_schedule_equals_the_tp_policy_in_traffic_and_trains_like_one_device(gpt,
                                                                                     gallery):
    sch = fresh(gpt)
    gallery("gpt_megatron.py:megatron")(sch)
    program = ct.compile(sch.plan())
    policy = ct.compile(tensor_parallel(gpt[1], 2))
    for rank in range(2):
        assert program.traffic(rank) == policy.traffic(rank)
    matches(sch)


@pytest.mark.parametrize("model,blocks", [("hf-gpt2", "transformer.h"),
                                          ("hf-llama", "model.layers")])
def test_gallery_schedules_of_hugging_face_models_equal_the_tp_policy(model, blocks, gallery):
    workload = get_workload(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = ct.capture(workload)
    sch = ct.schedule(workload, devices=2, graph=graph)
    gallery(f"{model.replace('-', '_')}.py:megatron")(sch)
    assert sum(ct.compile(sch.plan()).traffic(0).values()) == \
        sum(ct.compile(tensor_parallel(graph, 2)).traffic(0).values())
    matches(sch, steps=1)


def test_a_tied_weight_is_sharded_by_any_of_its_names(gpt):
    sch = fresh(gpt)
    sch["lm_head"].shard("weight", axis=0)  # the same tensor as wte.weight
    sch["lm_head"].sync(mode="fwd_post", op="all_gather")
    layout, _, _ = analyse(gpt[1], sch._state.steps)
    lookup, head = gpt[1].op("embedding"), gpt[1].op("linear_16")
    assert layout.splits[head] == TpSplit("n") and layout.splits.get(lookup) is None
    matches(sch)


def test_a_shard_written_from_an_ancestor_lets_the_module_sync(gpt):
    sch = fresh(gpt)
    sch.shard("h.0.mlp.c_fc.weight", axis=0)
    sch["h.0"].shard("mlp.c_proj.weight", axis=1)
    sch["h.0.mlp.c_proj"].sync(mode="fwd_post", op="all_reduce")
    layout, _, _ = analyse(gpt[1], sch._state.steps)
    assert layout.splits[gpt[1].op("linear_3")] == TpSplit("k")
    matches(sch)


def test_sequence_parallel_syncs_cut_the_stretch_between_blocks_along_the_sequence(gpt):
    sch = megatron(fresh(gpt), sync=False)
    for i in range(4):
        for part in ("attn", "mlp"):
            sch[f"h.{i}.{part}.c_proj"].sync(mode="fwd_post", op="reduce_scatter")
            sch[f"h.{i}.{part}"].sync(mode="fwd_pre", op="all_gather")
    with pytest.raises(ct.ScheduleError, match=r"op view_16 \(top level\) reads linear_16's "
                       r"output.*cut along the sequence.*add sch\['lm_head'\]\.sync\("
                       r"mode='fwd_post', op='all_gather'\)"):
        sch.plan()
    sch["ln_f"].sync(mode="fwd_pre", op="all_gather")
    layout, _, _ = analyse(gpt[1], sch._state.steps)
    assert layout.seq[gpt[1].op("layer_norm_1")] == "d1"  # ln_2 of block 0 on its part
    code = ct.compile(sch.plan()).code(0)
    assert "rt.reduce_scatter(" in code and "rt.all_gather(" in code
    matches(sch)


@pytest.mark.parametrize("step,message", [
    (lambda s: s["lm_head"].shard("weight", 0),
     r"the output view_16 of op view_16 \(top level\) is cut; op cross_entropy_sum \(top "
     r"level\) cannot take it so.*add sch\['lm_head'\]\.sync\(mode='fwd_post', "
     r"op='all_gather'\)"),
    # the column's cut flows through the activation into c_proj, which sums over it
    (lambda s: s["h.0.mlp.c_fc"].shard("weight", 0),
     r"the output linear_3 of op linear_3 \(module h.0.mlp.c_proj\) is partial sums; op add_2 "
     r"\(module h.0\).*add sch\['h.0.mlp.c_proj'\]\.sync\(mode='fwd_post', op='all_reduce'\)"),
    (lambda s: (s["h.0.mlp.c_fc"].shard("weight", 0),
                s["h.0.mlp.c_fc"].sync(mode="fwd_post", op="all_reduce")),
     r"reaches it as cut, which all_reduce does not make whole; use op='all_gather'"),
    (lambda s: (megatron(s, blocks=[0]), s["h.0.attn.c_proj"].sync(mode="bwd_post")),
     r"sch\['h.0.attn.c_proj'\]\.sync\(mode='bwd_post', op='all_reduce'\): no cut op in it "
     r"reads a whole input"),
    (lambda s: (megatron(s, blocks=[0]), s["h.0"].sync(mode="fwd_post", op="all_reduce")),
     r"sch\['h.0'\]\.sync\(mode='fwd_post', op='all_reduce'\): nothing cut or partial leaves "
     r"h.0, so the sync has nothing to do"),
    (lambda s: (s["h.0.attn.c_proj"].shard("weight", 1), s["h.0.attn.c_proj"].shard("bias", 0)),
     r"op linear_1 \(module h.0.attn.c_proj\) would be cut two ways: along k for "
     r"sch\['h.0.attn.c_proj'\]\.shard\('weight', axis=1\); along n for"),
    (lambda s: s["wte"].shard("weight", 0),
     r"sch\['wte'\]\.shard\('weight', axis=0\): op embedding \(module wte\) reads wte.weight "
     r"but cannot be cut along axis 0: its signature .* does not split that axis"),
], ids=["cut-meets-whole", "partial-meets-whole", "wrong-collective", "bwd-on-row",
        "fwd-with-nothing", "two-ways", "unsplittable"])
def test_a_sharded_stretch_without_the_right_sync_is_refused_with_the_fix(gpt, step, message):
    sch = fresh(gpt)
    step(sch)
    with pytest.raises(ct.ScheduleError, match=message):
        sch.plan()


def test_steps_that_cannot_apply_are_refused_as_they_are_applied(gpt):
    sch = fresh(gpt)
    with pytest.raises(ct.ScheduleError, match=r"nothing in h.0 is sharded; shard its "):
        sch["h.0"].sync()
    with pytest.raises(ct.ScheduleError, match=r"no such parameter; its parameters: "
                       r"c_attn.weight, c_attn.bias"):
        sch["h.0.attn"].shard("weight", 0)
    with pytest.raises(ct.ScheduleError, match=r"h.0.attn.c_attn.weight has 2 axes"):
        sch["h.0.attn.c_attn"].shard("weight", 2)
    with pytest.raises(ct.ScheduleError, match="mode is one of fwd_pre, fwd_post, bwd_post"):
        sch["h.0.attn.c_attn"].shard("weight", 0).sync(mode="forward")
    with pytest.raises(ct.ScheduleError, match="already cuts it along another axis"):
        sch["h.0.attn.c_attn"].shard("weight", 1)
    with pytest.raises(ct.ScheduleError, match=r"this schedule has 1; make it with "):
        fresh(gpt, devices=1)["h.0.attn.c_attn"].shard("weight", 0)
    with pytest.raises(ct.ScheduleError, match=r"would cut its dim n of size 192 into 3 fused "
                       r"parts x 3 devices, which does not divide it"):
        megatron(fresh(gpt, devices=3)).plan()


# ---- activations ------------------------------------------------------------------------

def test_checkpoint_and_swap_mark_a_module_or_a_found_subgraph(gpt):
    sch = megatron(fresh(gpt))
    sch["h.0"].checkpoint()
    attention = sch["h.1.attn"].find("attention")
    sch["h.1.attn"].checkpoint(attention)
    sch["h.2.mlp"].swap()
    plan = sch.plan()
    recomputed = {p.op.name for p in plan.recomputed}
    assert {op.name for op in sch["h.0"].ops()} <= recomputed
    assert "scaled_dot_product_attention_1" in recomputed and "linear_5" not in recomputed
    assert {p.op.name for p in plan.swapped} == {op.name for op in sch["h.2.mlp"].ops()}
    with pytest.raises(ct.ScheduleError, match="is checkpointed already"):
        sch["h.0.mlp"].swap()
    matches(sch)


def test_find_matches_kinds_names_chains_and_functions(gpt):
    sch = fresh(gpt)
    assert [[op.name for op in s] for s in sch["h.0"].find(["linear", "gelu"])] == \
        [["linear_2", "gelu"]]
    assert len(sch.find("linear")) == 17 and len(sch["h.1"].find("linear_[0-9]+")) == 4
    assert len(sch.find(lambda op: op.kind == "attention")) == 4
    assert sch["h.0"].find(["gelu", "attention"]) == []


# ---- rewriting and fusing ---------------------------------------------------------------

def erf_gelu(h):
    return 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))


class ErfGeluMLP(nn.Module):
    """GPT's MLP with its GELU written out; the weights are the old module's."""

    def __init__(self, old):
        super().__init__()
        self.c_fc, self.c_proj = old.c_fc, old.c_proj

    def forward(self, x):
        return self.c_proj(erf_gelu(self.c_fc(x)))


def test_decompose_splits_the_bias_out_and_fuse_compiles_the_chain_in_the_code(gpt):
    sch = fresh(gpt)
    mlp = sch["h.0.mlp"]
    mlp.decompose()
    assert [op.kind for op in mlp.ops()] == ["linear", "add", "gelu", "linear", "add"]
    assert gpt[1].op("linear_2").kind == "linear" and len(sch.graph.ops) == len(gpt[1].ops) + 2
    chain = mlp.find(["add", "gelu"])
    assert [t.name for t in chain[0].inputs] == ["linear_v1", "h.0.mlp.c_fc.bias"]
    mlp.fuse(chain, compiler="aot_eager")
    megatron(sch)
    program = ct.compile(sch.plan())
    assert program.traffic(0) == ct.compile(megatron(fresh(gpt)).plan()).traffic(0)
    code = program.code(0)
    assert "def fused_0(" in code and "fused_0 = torch.compile(fused_0, backend='aot_eager')" \
        in code and "forward_" not in code  # only the fused ops, without --compile
    body = code[code.index("def fused_0("):code.index("fused_0 = torch.compile")]
    assert "operator.add(" in body and "gelu(" in body and "linear(" not in body
    with pytest.raises(ct.ScheduleError, match=r"add_v1 \(add\) is fused already"):
        mlp.fuse(chain)
    with pytest.raises(ct.ScheduleError, match="add_v1 is fused; a fused op runs once"):
        mlp.checkpoint()
    with pytest.raises(ct.ScheduleError, match="no linear or addmm op that adds a bias"):
        sch["h.0.attn.c_attn"].decompose().decompose()
    matches(sch)


def test_fuse_refuses_what_compiled_code_cannot_run_once(gpt, tmp_path):
    sch = fresh(gpt)
    sch["h.1"].checkpoint()
    with pytest.raises(ct.ScheduleError, match=r"op linear_6 \(linear\) is checkpointed"):
        sch["h.1.mlp"].fuse()
    with pytest.raises(ct.ScheduleError, match="no backend 'nope'"):
        sch["h.0"].fuse(compiler="nope")
    drop = ct.schedule(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)), torch.randn(2, 4),
                       lambda y: y.sum(), devices=1)
    with pytest.raises(ct.ScheduleError, match=r"\(dropout\) is random"):
        drop.fuse()
    sch["h.2.mlp"].fuse()  # the groups go through a plan file
    plan = sch.plan()
    plan.save(tmp_path / "plan.json")
    loaded = ct.load_plan(sch.graph, tmp_path / "plan.json")
    assert {(p.name, f) for p, f in loaded.fused.items()} == \
        {(p.name, f) for p, f in plan.fused.items()} and len(plan.fused) == 3 * 2


def test_replace_swaps_a_module_in_a_copy_and_captures_it_again(gpt):
    workload, graph = gpt
    sch = fresh(gpt)
    old = sch["h.1.mlp"].module
    sch["h.1.mlp"].replace(ErfGeluMLP(old))
    assert workload.model.h[1].mlp is old  # the user's model stays as written
    assert isinstance(sch.workload.model.h[1].mlp, ErfGeluMLP)
    assert "erf" in [op.kind for op in sch["h.1.mlp"].ops()]
    megatron(sch)  # shards and syncs of the new module's children
    matches(sch)  # against the model as written
    with pytest.raises(ct.ScheduleError, match="h.0.mlp.c_fc'\\].shard.* schedules the "
                       "module it replaces; replace it first"):
        sch["h.0.mlp"].replace(ErfGeluMLP(sch["h.0.mlp"].module))
    other = fresh(gpt)
    with pytest.raises(ct.ScheduleError, match="replace a module of the model"):
        other.replace(nn.Identity())
    with pytest.raises(ct.ScheduleError, match="a function replaces the subgraph"):
        other["h.0.mlp"].replace(erf_gelu)
    other["h.0.mlp"].decompose()
    with pytest.raises(ct.ScheduleError, match="would undo sch\\['h.0.mlp'\\].decompose"):
        other["h.1.mlp"].replace(ErfGeluMLP(old))
    renamed = fresh(gpt)
    renamed["h.0.mlp"].replace(nn.Sequential(nn.Linear(64, 64)))
    with pytest.raises(ct.ScheduleError, match="compares them by name"):
        renamed.verify()


def test_replace_rewrites_a_subgraph_with_a_function_of_its_inputs(gpt):
    sch = fresh(gpt, devices=4).replicate(2)
    gelu = sch["h.0.mlp"].find("gelu")
    sch["h.0.mlp"].replace(erf_gelu, gelu)
    assert [op.kind for op in sch["h.0.mlp"].ops()] == \
        ["linear", "mul", "truediv", "erf", "add", "mul", "linear"]
    with pytest.raises(ct.ScheduleError, match="op gelu \\(gelu\\) is no longer in the graph"):
        sch["h.0.mlp"].checkpoint(gelu)  # found before the rewrite
    sch["h.1.mlp"].checkpoint()
    sch["h.1.mlp"].replace(erf_gelu, sch["h.1.mlp"].find("gelu"))
    recomputed = {p.op.name for p in sch.plan().recomputed}
    assert {op.name for op in sch["h.1.mlp"].ops()} <= recomputed  # the new ops inherit it
    matches(sch)
    linears = sch["h.2.mlp"].find("linear")
    with pytest.raises(ct.ScheduleError, match=r"fails on the inputs it is given, in order "
                       r"\(layer_norm_5: float32\[4, 32, 64\], h.2.mlp.c_fc.weight"):
        sch["h.2.mlp"].replace(erf_gelu, linears)
    with pytest.raises(ct.ScheduleError, match=r"returns float32\[4, 32, 1\] where gelu_2 "
                       r"makes gelu_2: float32\[4, 32, 256\]"):
        sch["h.2.mlp"].replace(lambda h: h[..., :1], sch["h.2.mlp"].find("gelu"))
    with pytest.raises(ct.ScheduleError, match="has parameters or buffers of its own"):
        sch["h.2.mlp"].replace(nn.Linear(256, 256), sch["h.2.mlp"].find("gelu"))
    with pytest.raises(ct.ScheduleError, match="not one closed run of ops"):
        sch["h.2.mlp"].replace(lambda x, w, b, g, w2, b2: (g, x), linears)


def test_the_fused_gallery_schedule_equals_the_tp_policy_in_traffic(gpt, gallery):
    sch = fresh(gpt)
    gallery("gpt_fused.py:fused_quick")(sch)
    program = ct.compile(sch.plan())
    assert program.traffic(0) == ct.compile(tensor_parallel(gpt[1], 2)).traffic(0)
    assert program.code(1).count("= torch.compile(fused_") == 4
    matches(sch)


# ---- pipeline, placement, data parallel -------------------------------------------------

def test_pipeline_cuts_with_micro_batches_and_replicas_train_like_one_device(gpt):
    sch = megatron(fresh(gpt, devices=8))
    sch["h.1"].cut_pipeline_stage()
    sch.micro_batches(2, schedule="1f1b")
    sch.replicate(2)
    layout, tp, pp = analyse(gpt[1], sch._state.steps)
    assert (tp, pp) == (2, 2)
    assert layout.stage[gpt[1].op("add_4")] == 0 and layout.stage[gpt[1].op("add_5")] == 1
    plan = sch.plan()
    assert plan.ndevices == 8 and len(plan.cells) == 2 * 2 * 2  # groups x stages x micro
    matches(sch)


def test_pipeline_cuts_that_cannot_be_made_are_refused(gpt):
    sch = fresh(gpt)
    with pytest.raises(ct.ScheduleError, match="cut after a module of the model"):
        sch.cut_pipeline_stage()
    sch["h.3.mlp.c_proj"].cut_pipeline_stage()
    with pytest.raises(ct.ScheduleError, match=r"two pipeline cuts end at the same op "
                       r"\(h.3.mlp.c_proj, h.3.mlp\)"):
        sch["h.3.mlp"].cut_pipeline_stage()
    with pytest.raises(ct.ScheduleError, match="runs no op of the captured step"):
        sch["drop"].cut_pipeline_stage()

    class Twice(nn.Module):  # one module called twice: no stage can end "after" it
        def __init__(self):
            super().__init__()
            self.inner, self.mid = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.inner(self.mid(self.inner(x))).sum()

    twice = ct.schedule(Twice(), torch.randn(4, 8), devices=2)
    with pytest.raises(ct.ScheduleError, match=r"inner's ops are not one stretch"):
        twice["inner"].cut_pipeline_stage()
    with pytest.raises(ct.ScheduleError, match="applies to the whole model"):
        sch["h.0"].micro_batches(2)
    with pytest.raises(ct.ScheduleError, match="batch of 4 samples does not split into 8"):
        sch.micro_batches(8)


def test_place_runs_modules_on_chosen_devices(gpt):
    sch = fresh(gpt)
    sch["h.0"].place(0)
    sch["h.1"].place([1])
    sch["h.2"].place([0, 1])
    sch["h.2.mlp.c_fc"].shard("weight", 0)
    sch["h.2.mlp.c_proj"].shard("weight", 1).sync()
    plan = sch.plan()
    plan.check()
    devices = {p.op.name: p.device for p in plan.leaves(plan.graph.op("linear"))}
    assert devices == {"linear": 0}
    assert {p.device for p in plan.leaves("linear_4")} == {1}
    matches(sch)
    with pytest.raises(ct.ScheduleError, match=r"place\(\[2\]\): distinct devices in 0..1"):
        sch["h.3"].place(2)
    sch["h.3"].cut_pipeline_stage()
    with pytest.raises(ct.ScheduleError, match="both say where ops run"):
        sch.plan()


def test_replicate_is_data_parallel_over_groups(gpt):
    sch = fresh(gpt, devices=4).replicate(4)
    assert sch.plan().ndevices == 4
    matches(sch)
    with pytest.raises(ct.ScheduleError, match="must divide the 4 devices"):
        sch.replicate(3)
    with pytest.raises(ct.ScheduleError, match="applies to the whole model"):
        sch["h.0"].replicate(2)


# ---- extending --------------------------------------------------------------------------

def test_a_registered_primitive_is_a_method_of_every_schedule(gpt, gallery):
    gallery("megatron_block.py:megatron")  # importing it registers the primitive
    sch = fresh(gpt)
    for i in range(4):
        sch[f"h.{i}"].megatron()
    assert "sch['h.0.attn.c_attn'].shard('weight', axis=0)" in sch.steps
    assert "sch['h.0.mlp.c_proj'].sync(mode='fwd_post', op='all_reduce')" in sch.steps
    layout, _, _ = analyse(gpt[1], sch._state.steps)
    assert layout.splits[gpt[1].op("linear")] == TpSplit("n", 3)
    matches(sch)
    with pytest.raises(ct.ScheduleError, match="'shard' is a built-in schedule primitive"):
        ct.schedule_primitive(lambda sch: sch, name="shard")
    with pytest.raises(AttributeError, match="registered: megatron"):
        sch.nope()


def test_the_registered_primitive_makes_sequence_parallel_schedules_too(gpt, gallery):
    sch = fresh(gpt)
    gallery("gpt_sequence.py:sequence_parallel")(sch)
    assert "sch['h.0.attn.c_proj'].sync(mode='fwd_post', op='reduce_scatter')" in sch.steps
    assert "sch['h.0.mlp.c_fc'].sync(mode='fwd_pre', op='all_gather')" in sch.steps
    layout, _, _ = analyse(sch.graph, sch._state.steps)
    assert layout.seq[sch.graph.op("layer_norm_1")] == "d1"  # between blocks: on a part
    traffic = ct.compile(sch.plan()).traffic(0)
    assert traffic["reduce_scatter"] > 0 and traffic["all_gather"] > 0
    matches(sch)


def rewritten_megatron(sch: ct.Schedule) -> ct.Schedule:
    """Every primitive but the pipeline's and place, on one schedule."""
    sch["h.1.mlp"].replace(ErfGeluMLP(sch["h.1.mlp"].module))
    megatron(sch).replicate(2)
    sch["h.0"].checkpoint()
    sch["h.2.mlp"].decompose()
    sch["h.2.mlp"].fuse(sch["h.2.mlp"].find(["add", "gelu"]), compiler="aot_eager")
    sch["h.3.mlp"].replace(erf_gelu, sch["h.3.mlp"].find("gelu"))
    sch["h.3.attn"].swap(sch["h.3.attn"].find("attention"))
    return sch


def pipelined(sch: ct.Schedule) -> ct.Schedule:
    sch["h.1"].cut_pipeline_stage()
    return sch.micro_batches(2, schedule="1f1b")


def placed(sch: ct.Schedule) -> ct.Schedule:
    sch["h.0"].place(0)
    sch["h.1"].place(1)
    return sch


@pytest.mark.slow
@pytest.mark.parametrize("devices, steps", [(4, rewritten_megatron), (2, pipelined),
                                            (2, placed)])
def test_a_schedule_verifies_on_gloo_processes(gpt, devices, steps):
    result = steps(fresh(gpt, devices=devices)).verify(steps=2, backend="gloo")
    assert result.within(1e-5), str(result)


def test_the_progressive_story_verifies_every_step_and_checkpointing_saves_memory(gallery):
    rows = gallery("story.py:story")()
    assert [row["matches"] for row in rows] == [True] * 4
    memory = [row["peak_memory"] for row in rows]
    assert memory[2] < memory[1] and memory[3] < memory[2]
