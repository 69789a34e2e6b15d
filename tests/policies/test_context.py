"""Context parallelism: every op cut along the sequence, equal to one device."""

import pytest
import torch
from plan_testing import captured, trains_like_one_device
from torch.utils._pytree import tree_leaves

import chronotope as ct
from chronotope.compile.program import AllGather, Forward, Refill, Reshard, Wait
from chronotope.cost.compute import piece_flops
from chronotope.errors import PlanError
from chronotope.plan.files import save_plan
from chronotope.policies import ParallelConfig, make, mesh
from chronotope.policies.context import context
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.precision import BF16_TOLERANCE, Precision
from chronotope.runtime.reference import compare, train_reference


def _attention_flops(plan: ct.Plan) -> list[float]:
    """Each device's forward attention FLOPs."""
    per = [0.0] * plan.ndevices
    for piece in plan.check().sequences.values():
        for op in piece:
            if op.op.kind == "attention" and not op.is_backward:
                per[op.device] += piece_flops(op)
    return per


@pytest.mark.parametrize("model", ["gpt", "llama", "bert", "hf-llama"])
@pytest.mark.parametrize("attention", ["allgather", "ring", "ulysses"])
def test_each_attention_variant_trains_like_one_device(model, attention):
    w, graph = captured(model)
    trains_like_one_device(w, ct.compile(mesh(graph, cp=4, cp_attention=attention)))


@pytest.mark.parametrize("shape", [
    dict(dp=2, cp=2), dict(cp=2, tp=2), dict(cp=2, tp=2, sequence=True),
    dict(cp=2, pp=2, micro=2, schedule="1f1b", fold=True),
    dict(cp=2, pp=2, micro=2, schedule="gpipe"), dict(cp=2, pp=2, micro=4, schedule="1f1b"),
    dict(cp=2, tp=2, pp=2, micro=4, schedule="zb1", fold=True),
    dict(cp=2, recompute="full"), dict(cp=2, micro=2, fold=True),
    *(dict(cp=2, cp_attention="ring", **more) for more in (
        dict(dp=2), dict(tp=2), dict(pp=2, micro=2, schedule="1f1b", fold=True),
        dict(recompute="full"), dict(zigzag=False)))])
def test_context_parallel_combines_with_the_other_axes(shape):
    w, graph = captured("gpt")
    trains_like_one_device(w, ct.compile(mesh(graph, **shape)))


def test_every_activation_along_the_sequence_is_cut():
    """Embeddings, norms, MLPs, attention and the token loss: each is cut along the
    sequence, past the flatten of (b t) before the loss."""
    _, graph = captured("llama")
    ctx = context(graph, 2)
    cut = {op.name for op, c in ctx.cuts.items() if c is not None}
    assert {"embedding", "mean", "linear", "scaled_dot_product_attention", "silu",
            "cross_entropy_sum"} <= cut
    # what never sees the batch's sequence: the rotary tables, the loss's last division
    assert {op.name for op in graph.ops} - cut == {"getitem", "getitem_1", "cross_entropy"}


def test_zigzag_gives_every_device_the_same_causal_work():
    _, graph = captured("gpt", block_size=64)
    balanced = _attention_flops(mesh(graph, cp=4))
    plain = _attention_flops(mesh(graph, cp=4, zigzag=False))
    assert max(balanced) / min(balanced) <= 1.05
    assert max(plain) / min(plain) >= 4  # the last chunk sees four times the first's keys


def test_activations_per_device_fall_with_the_group():
    _, graph = captured("gpt", block_size=64, d_model=128, vocab_size=128)
    peak = [mesh(graph, cp=cp).check().memory[0].activations for cp in (1, 2, 4)]
    assert peak[1] < 0.62 * peak[0] and peak[2] < 0.62 * peak[1], peak


def test_what_context_parallelism_cannot_cut_is_refused_by_name():
    _, graph = captured("gpt", block_size=24)
    with pytest.raises(PlanError, match="sequence length divisible by 16"):
        mesh(graph, cp=8)  # a zigzag of 16 chunks
    _, graph = captured("gpt")
    with pytest.raises(PlanError, match="heads"):
        mesh(graph, cp=8, cp_attention="ulysses")  # 4 heads
    _, swin = captured("swin")
    with pytest.raises(PlanError, match="no scaled_dot_product_attention"):
        mesh(swin, cp=2)
    with pytest.raises(PlanError, match="cp_attention='butterfly'"):
        make(graph, ParallelConfig("cp", 4, cp_attention="butterfly"))


def test_the_cp_policy_reads_its_options():
    _, graph = captured("gpt")
    plan = make(graph, ParallelConfig("cp", 4, tp=2))
    assert plan.ndevices == 4
    with pytest.raises(PlanError, match="does not read cp"):
        make(graph, ParallelConfig("tp", 4, cp=2))
    with pytest.raises(PlanError, match="does not divide"):
        make(graph, ParallelConfig("dp-tp", 4, tp=2, cp=4))


def test_gathered_keys_and_values_are_freed_after_their_forward_and_gathered_again():
    """Each rank keeps its own chunks of every layer's keys and values, not all of them:
    the gathered copy is freed once the layer's attention ran, and gathered again for its
    backward (one layer ahead), in one call with the zigzag's two chunks per rank."""
    w, graph = captured("gpt", block_size=1024, d_model=32, n_layer=6, batch_size=1,
                        vocab_size=64)
    plan = mesh(graph, cp=4)
    program = ct.compile(plan)
    code = program.ranks[1]
    gathers = [ins for ins in code if isinstance(ins, AllGather) and ins.slots]
    assert gathers and all(sorted(g.slots) == [0, 0, 1, 1, 2, 2, 3, 3] for g in gathers)
    assert sum(isinstance(ins, Reshard) for ins in code) == 5  # the last layer's is read on
    assert sum(isinstance(ins, Refill) for ins in code) == 5
    kept = mesh(graph, cp=4)
    kept.regather = False
    peaks = [max(run_in_threads(ct.compile(p), w, 1, Optim("sgd", 0.1),
                                measure_memory=True).peak_memory) for p in (plan, kept)]
    assert peaks[0] < peaks[1], peaks
    trains_like_one_device(w, program)


def test_context_parallel_trains_in_bf16_like_one_device_under_autocast():
    """A late chunk's two flash calls run in the dtype autocast gives attention."""
    w, graph = captured("gpt")
    plan = mesh(graph, cp=4)
    plan.dtype = "bf16"
    run = run_in_threads(ct.compile(plan), w, 2, Optim("sgd", 0.1))
    reference = train_reference(w, 2, Optim("sgd", 0.1), Precision("bf16"))
    assert compare(run, reference).within(BF16_TOLERANCE)


def test_a_ring_lands_the_keys_and_values_as_attention_takes_them(tmp_path):
    """Each gather of keys and values for attention is steps round the ring, its outputs
    handed to the attention pieces at once (each waits for the blocks its rows see), and
    the whole of it in before its storage is freed; a plan file keeps the ring."""
    _, graph = captured("gpt")
    plan = mesh(graph, cp=4, cp_attention="ring")
    program = ct.compile(plan)
    layers = sum(op.kind == "attention" for op in graph.ops)
    for code in program.ranks:
        rings = {ins.handle: i for i, ins in enumerate(code)
                 if isinstance(ins, AllGather) and ins.ring}
        assert len(rings) == 2 * layers  # the keys and the values of each
        for handle, at in rings.items():
            landing = [i for i, ins in enumerate(code) if isinstance(ins, Wait)
                       and ins.handle == handle]
            readers = [i for i, ins in enumerate(code) if isinstance(ins, Forward)
                       and handle in {s[0] for s in ins.arriving if s is not None}]
            whole = landing[-1]
            freed = [i for i, ins in enumerate(code) if isinstance(ins, Reshard)
                     and set(ins.vars) & set(code[at].vars)]  # not the last layer's
            assert code[landing[0]].landing and not code[whole].landing
            assert at < landing[0] < readers[0] and readers[-1] < whole
            assert all(whole < i for i in freed)
            assert all(code[r].op.op.kind == "attention" for r in readers)
    path = tmp_path / "ring.json"
    save_plan(plan, path)
    assert ct.load_plan(graph, path).ring


@pytest.mark.parametrize("model", ["gpt", "hf-llama"])
def test_a_ring_backward_sends_each_run_s_gradients_round_the_ring_as_attention_makes_them(
        model, monkeypatch):
    """The gradients of a ring's keys and values leave for their owners from inside the
    attention's backward (a step of the ring each, once every piece here gave its part),
    not as messages after it: every layer's backward on every rank leaves, nothing else
    communicates among its calls, and every step starts inside autograd."""
    import torch

    from chronotope.compile.program import COLLECTIVES, Backward, Leave, Recv, Send
    from chronotope.runtime.context import Leaving

    w, graph = captured(model)
    program = ct.compile(mesh(graph, cp=4, cp_attention="ring"))
    layers = sum(op.kind == "attention" for op in graph.ops)
    for code in program.ranks:
        leaves = [i for i, ins in enumerate(code) if isinstance(ins, Leave)]
        assert len(leaves) == layers
        for at in leaves:
            end = next(i for i, ins in enumerate(code) if i > at and isinstance(ins, Wait)
                       and ins.handle == code[at].handle)
            window = code[at + 1:end]
            assert any(isinstance(ins, Backward) and any(
                op.forward_op.op.kind == "attention" for op in ins.ops) for ins in window)
            assert not any(isinstance(ins, (Send, Recv, Wait, *COLLECTIVES)) for ins in window)
    started = []
    start = Leaving._start_ready

    def recorded(self):
        before = self.step
        start(self)
        started.extend([torch._C._current_graph_task_id() != -1] * (self.step - before))

    monkeypatch.setattr(Leaving, "_start_ready", recorded)
    trains_like_one_device(w, program)
    assert started and all(started)  # every step from inside the backward, as it goes


def test_a_ring_backward_makes_no_gradient_of_the_whole_keys_and_values(monkeypatch):
    """Each run's gradient leaves for its owner, or is summed in the leaving where it is
    this rank's own, as the pieces give them: a tensor the size of the whole gathered keys
    is made by the gathers alone (the forward's and the backward's), never as a piece's
    gradient of them (two per query chunk of a zigzag, zeros but for its own runs)."""
    import chronotope.runtime.local as local

    whole, made = (2, 4, 64, 8), []  # batch, heads, all the tokens, head size

    class Watch(local.PeakMemory):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor)}
            made.extend(str(func) for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                        and tuple(t.shape) == whole and t.untyped_storage()._cdata not in given
                        and t.untyped_storage().nbytes() == t.numel() * t.element_size())
            return out

    monkeypatch.setattr(local, "PeakMemory", Watch)
    w, graph = captured("gpt", block_size=64, d_model=32, n_head=4, n_layer=2, vocab_size=64,
                        batch_size=2)
    run_in_threads(ct.compile(mesh(graph, cp=2, cp_attention="ring")), w, 1,
                   Optim("sgd", 0.1), measure_memory=True)
    assert made and set(made) <= {"aten.new_empty.default", "aten.cat.default"}, made


def test_a_ring_backward_holds_no_more_than_the_gathered_one():
    """What a ring's backward keeps for its steps (each layer's keys and values, the
    gradients that came) goes once its layer's backward is done: its peak is the
    all-gather's, however many layers came before."""
    w, graph = captured("llama", seq_len=512, d_model=128, n_head=8, n_kv_head=2, n_layer=8,
                        vocab_size=512, batch_size=2)
    peaks = {a: max(run_in_threads(ct.compile(mesh(graph, cp=4, cp_attention=a)), w, 1,
                                   Optim("sgd", 0.1), measure_memory=True).peak_memory)
             for a in ("allgather", "ring")}
    assert peaks["ring"] <= peaks["allgather"] * 1.01, peaks
