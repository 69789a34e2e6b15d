"""Reads that are collectives are written as collectives: lowering writes the ones it
recognises with no messages (a refused one is lowered again as messages), and layout
changes that are all-to-alls and broadcasts become those collectives."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chronotope as ct
from chronotope.compile.arrange import arrange
from chronotope.compile.materialize import Lowering
from chronotope.compile.program import (
    AllReduce,
    AllToAll,
    Assemble,
    Broadcast,
    Recv,
    ReduceScatter,
    Send,
)
from chronotope.graph.axes import batch_dims
from chronotope.models import get_workload
from chronotope.policies import ParallelConfig, make
from chronotope.policies.zero import cut_update
from chronotope.runtime.launch import run_processes
from chronotope.runtime.local import Optim, run_in_threads
from chronotope.runtime.reference import compare, train_reference


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).pow(2).mean()


def workload(batch: int) -> ct.Workload:
    torch.manual_seed(0)
    return ct.Workload(TwoLinears(), (torch.randn(batch, 8, 16),), name="two-linears")


def sequence_then_batch(w: ct.Workload) -> ct.Plan:
    """The first linear split along the sequence, the rest along the batch, on 2 devices:
    the relu reads its batch run of what both sequence halves made."""
    graph = ct.capture(w)
    plan = ct.Plan(graph, 2)
    dims = {"linear": "b1", "relu": "d0", "linear_1": "b0", "pow_1": "d0", "mean": "d0"}
    for op in graph:
        for device, piece in enumerate(plan.trans(op, ct.Split(dims[op.name], 2))):
            plan.assign(piece, device)
    return plan


def one_to_all(w: ct.Workload) -> ct.Plan:
    """The first linear on device 0 alone; the relu replicated on all 3 devices, each
    reading the whole of device 0's output; the rest split along the batch."""
    graph = ct.capture(w)
    plan = ct.Plan(graph, 3)
    for op in graph:
        if op.name == "linear":
            plan.assign(plan.trans(op, ct.Replicate(1))[0], 0)
            continue
        algo = ct.Replicate(3) if op.name == "relu" else ct.Split(
            "d0" if op.name != "linear_1" else "b0", 3)
        for device, piece in enumerate(plan.trans(op, algo)):
            plan.assign(piece, device)
    return plan


class TiedEmbedding(nn.Module):
    """One weight read by two ops: the embedding and the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(idx))
        return F.linear(h, self.emb.weight).pow(2).mean()


def tied(zero: bool) -> tuple[ct.Workload, ct.Plan]:
    """The embedding cut along its width (each device makes a slice of the weight's
    gradient), the projection along the batch (each makes a partial sum of all of it);
    ``zero``: the weight's update cut over the devices too."""
    torch.manual_seed(0)
    w = ct.Workload(TiedEmbedding(), (torch.randint(0, 32, (4, 8)),), name="tied")
    graph = ct.capture(w)
    plan = ct.Plan(graph, 2)
    for op in graph:
        dim = "d" if op.name == "embedding" else "b0" if op.name == "linear" else "d0"
        for device, piece in enumerate(plan.trans(op, ct.Split(dim, 2))):
            plan.assign(piece, device)
    if zero:
        cut_update(plan, "emb.weight")
    return w, plan


def kinds(program: ct.Program, rank: int) -> set[type]:
    return {type(ins) for ins in program.ranks[rank]}


def assert_trains_like_one_device(program: ct.Program, w: ct.Workload, processes: bool):
    run = (run_processes if processes else run_in_threads)(program, w, 2, Optim("sgd", 0.1))
    diff = compare(run, train_reference(w, 2, Optim("sgd", 0.1)))
    assert diff.max_loss_rel_diff <= 1e-5 and diff.max_param_rel_diff <= 1e-5, diff


def test_a_change_of_split_dim_is_one_all_to_all_each_way():
    w = workload(4)
    program = ct.compile(sequence_then_batch(w))
    for rank in range(2):
        code = program.ranks[rank]
        exchanges = [i for i in code if isinstance(i, AllToAll)]
        assert len(exchanges) == 2  # the activation forward, its gradient backward
        assert (exchanges[0].dim, exchanges[0].split) == (1, 0)  # join seq, keep own batch
        assert "rt.all_to_all(" in program.code(rank)
    # No messages: the loss's halves are summed in the gradients' all-reduce.
    assert not any(isinstance(i, (Send, Recv)) for code in program.ranks for i in code)
    assert program.traffic(0)["all_to_all"] > 0 and program.traffic(0)["p2p"] == 0
    assert_trains_like_one_device(program, w, processes=False)


def test_one_piece_read_whole_by_many_is_a_broadcast():
    w = workload(6)
    program = ct.compile(one_to_all(w))
    casts = [[i for i in program.ranks[r] if isinstance(i, Broadcast)] for r in range(3)]
    assert all(len(c) == 1 for c in casts)
    assert casts[0][0].src is not None and casts[1][0].var is not None  # root sends, others get
    assert {c[0].ranks for c in casts} == {(0, 1, 2)}
    assert "rt.broadcast(" in program.code(1)
    assert_trains_like_one_device(program, w, processes=False)


@pytest.mark.parametrize("zero,collective", [(False, AllReduce), (True, ReduceScatter)])
def test_a_gradient_made_in_pieces_of_two_layouts_is_summed_locally_then_reduced_once(
        zero, collective):
    """Each rank adds its slice into its partial sum, and one collective reduces that:
    no rank sends its gradient to every other."""
    w, plan = tied(zero)
    program = ct.compile(plan)
    for rank in range(2):
        code = program.ranks[rank]
        assert not any(isinstance(i, Send) and i.var.startswith("d_emb") for i in code)
        assert any(isinstance(i, collective) for i in code)
        assert any(isinstance(i, Assemble) and i.var == "grad_emb_weight__local" and
                   len(i.parts) > 1 for i in code)
    assert_trains_like_one_device(program, w, processes=False)


def test_readers_of_replicated_partial_sums_each_reduce_among_their_own_replicas():
    """Every op cut along the batch over two groups and copied within each (a 2 x 2 mesh):
    each weight's gradient is partial over the groups and copied in them. A reader takes
    the copies at its own position, so copies 0 and copies 1 each run one all-reduce."""
    w = workload(4)
    graph = ct.capture(w)
    batch = batch_dims(graph)
    plan = ct.Plan(graph, 4)
    for op in graph:
        for i, half in enumerate(plan.trans(op, ct.Split(batch[op], 2))):
            for j, copy in enumerate(plan.trans(half, ct.Replicate(2))):
                plan.assign(copy, 2 * i + j)
    program = ct.compile(plan)
    for rank, code in enumerate(program.ranks):
        assert not any(isinstance(i, Send) and i.var.startswith("d_") for i in code)
        assert {i.ranks for i in code if isinstance(i, AllReduce)} == {(rank % 2, rank % 2 + 2)}
    assert_trains_like_one_device(program, w, processes=False)


def lowered(checked, refused=frozenset()):
    """What lowering writes for ``checked``, before any pass, and the lowering."""
    low = Lowering(checked, refused=refused)
    low.lower()
    return arrange(low.written, low.sequences, low.cells), low


@pytest.mark.parametrize("config", [ParallelConfig("dp", 4), ParallelConfig("tp", 2),
                                    ParallelConfig("zero-3", 2),
                                    ParallelConfig("dp-tp", 4, tp=2)],
                         ids=["dp", "tp", "zero-3", "dp-tp"])
def test_lowering_writes_the_collectives_it_recognises_without_messages(config):
    """Data parallel's gradients, tensor parallel's partial sums, ZeRO-3's gathered
    weights: lowering writes each as the collective, not k(k-1) messages for a pass to
    regroup; and every member agrees, so nothing is lowered twice (gpt ties its embedding
    to its head: each rank's own embedding gradient is one replica, not a collective)."""
    checked = make(ct.capture(get_workload("gpt")), config).check()
    code, _ = lowered(checked)
    assert any(isinstance(i, Assemble) and i.pattern is not None for i in code[0])
    program = Lowering(checked).run()  # raises Refused where it would lower again
    assert any(isinstance(i, (AllReduce, ReduceScatter)) for i in program.ranks[0])

    def messages(ranks):
        return sorted((r, i.dst, i.tag) for r, c in enumerate(ranks) for i in c
                      if isinstance(i, Send))
    assert messages(code) == messages(program.ranks)  # none written for a pass to drop


def test_a_refused_collective_is_lowered_as_messages_and_trains_alike():
    """Where the passes refuse a collective (its members disagree, or some rank would wait
    in it forever), lowering writes those reads again as messages."""
    w = workload(4)
    graph = ct.capture(w)
    plan = ct.Plan(graph, 2)
    batch = batch_dims(graph)
    for op in graph:
        for device, piece in enumerate(plan.trans(op, ct.Split(batch[op], 2))):
            plan.assign(piece, device)
    checked = plan.check()
    code, _ = lowered(checked)
    keys = frozenset(i.pattern.key for rank in code for i in rank
                     if isinstance(i, Assemble) and i.pattern is not None)
    assert keys
    again, _ = lowered(checked, keys)
    assert not any(isinstance(i, Assemble) and i.pattern is not None for r in again for i in r)
    assert any(isinstance(i, Send) for r in again for i in r)
    program = Lowering(checked, refused=keys).run()
    assert not any(isinstance(i, AllReduce) and set(i.keys) & keys
                   for r in program.ranks for i in r)
    assert_trains_like_one_device(program, w, processes=False)


@pytest.mark.slow
@pytest.mark.parametrize("build,batch", [(sequence_then_batch, 4), (one_to_all, 6)])
def test_all_to_all_and_broadcast_on_gloo(build, batch):
    w = workload(batch)
    program = ct.compile(build(w))
    assert kinds(program, 0) & {AllToAll, Broadcast}
    assert_trains_like_one_device(program, w, processes=True)
