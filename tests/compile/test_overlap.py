"""Communication started early and waited on late, in the order NCCL matches messages."""


import pytest
import torch

import chronotope as ct
from chronotope.compile.program import (
    STARTED,
    AllGather,
    AllReduce,
    Backward,
    Forward,
    PullParam,
    PushParam,
    Recv,
    Send,
    Wait,
    reads,
    results,
)
from chronotope.compile.replay import Costs, replay
from chronotope.compile.reshard import is_regather
from chronotope.policies import data_parallel, mesh, sequence_parallel, zero
from tests.policies.plan_testing import captured


@pytest.fixture(scope="module")
def gpt():
    return captured("gpt", n_layer=2, d_model=32, n_head=2, block_size=16, batch_size=8)[1]


PLANS = {
    "dp2 x pp2 1f1b": lambda g: mesh(g, dp=2, pp=2, micro=4, schedule="1f1b"),
    "pp4 interleaved": lambda g: mesh(g, pp=2, micro=4, schedule="interleaved", chunks=2),
    "pp2 zb1": lambda g: mesh(g, pp=2, micro=4, schedule="zb1"),
    "tp2 x pp2 gpipe": lambda g: mesh(g, tp=2, pp=2, micro=2),
    "tp4 sequence": lambda g: sequence_parallel(g, 4),
    "zero3": lambda g: zero(g, 4, stage=3),
}


def pair_orders(code: list, rank: int) -> dict[int, list[tuple]]:
    """For each peer, the messages this rank posts with it, in its order."""
    out: dict[int, list[tuple]] = {}
    for ins in code:
        if isinstance(ins, (Send, PushParam)):
            out.setdefault(ins.dst, []).append((rank, ins.dst, ins.tag))
        elif isinstance(ins, (Recv, PullParam)):
            out.setdefault(ins.src, []).append((ins.src, rank, ins.tag))
    return out


@pytest.mark.parametrize("plan", list(PLANS))
def test_every_pair_of_ranks_posts_its_messages_in_one_order(gpt, plan):
    program = ct.compile(PLANS[plan](gpt), comm="p2p")
    for code in (program.ranks, program.refresh):
        orders = [pair_orders(c, r) for r, c in enumerate(code)]
        for a, peers in enumerate(orders):
            for b, messages in peers.items():
                assert messages == orders[b][a], (plan, a, b)


def test_a_pipeline_posts_receives_ahead_of_the_compute_before_their_use(gpt):
    program = ct.compile(mesh(gpt, pp=2, micro=4, schedule="1f1b"))
    code = program.ranks[1]
    ahead = 0
    for i, ins in enumerate(code):
        if isinstance(ins, Recv) and ins.handle is not None:
            wait = next(j for j in range(i, len(code)) if isinstance(code[j], Wait)
                        and code[j].handle == ins.handle)
            ahead += any(isinstance(c, (Forward, Backward)) for c in code[i:wait])
    assert ahead >= 3  # the activations of micro-batches 1..3 arrive during compute
    assert "async_op=True)" in program.code(1) and ".wait()" in program.code(1)


@pytest.mark.parametrize("plan", list(PLANS))
def test_every_started_call_is_waited_on_just_before_its_result_is_read(gpt, plan):
    program = ct.compile(PLANS[plan](gpt))
    for code in program.ranks:
        for i, ins in enumerate(code):
            if not isinstance(ins, STARTED) or ins.handle is None:
                continue
            wait = next(j for j in range(i, len(code))
                        if isinstance(code[j], Wait) and code[j].handle == ins.handle)
            assert code[wait].vars == results(ins)
            between = {v for c in code[i + 1:wait] for v in reads(c)}
            assert not between & set(results(ins))
            assert wait > i + 1  # something runs while it is under way
            # a broadcast's root is waited on at the end; so is the loss a rank sums for
            # rank 0 to report (where it rides in no bucket: ZeRO's are reduce-scatters)
            reported = isinstance(ins, AllReduce) and ins.keys[0].tensor == gpt.loss.name
            if results(ins) and not reported:
                assert any(set(reads(c)) & set(results(ins)) for c in code[wait + 1:])


class Fixed(Costs):
    """Compute takes 1 s, a message 3 s."""

    def local(self, rank, ins, since):
        return 1.0 if isinstance(ins, Forward) else 0.0

    def message(self, src, dst, nbytes, ready, since):
        return ready + 3.0, 3.0


def test_the_replay_overlaps_a_started_receive_with_the_compute_before_its_wait(gpt):
    """A message travels once its receive is posted: posted before 2 s of compute, the
    3 s message is there at 3 s; posted after them, at 5 s."""
    program = ct.compile(mesh(gpt, pp=2), comm="p2p")
    forward = next(i for i in program.ranks[0] if isinstance(i, Forward))
    send = Send("x", (), 1, 99)
    blocking = [[send], [forward, forward, Recv("x", (1,), torch.float32, 0, 99)]]
    started = [[send], [Recv("x", (1,), torch.float32, 0, 99, handle="h"), forward, forward,
                        Wait("h", ("x",))]]
    played = replay(blocking, Fixed())
    assert (played.clock[1], played.comm[1]) == (5.0, 3.0)
    played = replay(started, Fixed())
    assert (played.clock[1], played.comm[1]) == (3.0, 1.0)


def test_a_loss_count_all_reduce_starts_with_the_step_and_is_waited_on_at_the_loss(gpt):
    """The token count needs only the targets: summed while the whole forward runs, not in
    the middle of it (where every replica would wait for the slowest)."""
    code = ct.compile(data_parallel(gpt, 2)).ranks[0]
    start = next(i for i, ins in enumerate(code) if isinstance(ins, STARTED))
    assert "count" in code[start].keys[0].tensor and code[start].handle is not None
    first_forward = next(i for i, ins in enumerate(code)
                         if isinstance(ins, Forward) and any(ins.grad))
    wait = next(i for i, ins in enumerate(code)
                if isinstance(ins, Wait) and ins.handle == code[start].handle)
    assert start < first_forward < wait


def test_zero3_gathers_each_pieces_parameters_while_the_piece_before_it_computes(gpt):
    """FSDP's prefetch, per block: a unit's gathers (one layer of the stack, or a top-level
    module) start together in one flat call when the previous unit's first reader starts,
    so the compute before their readers hides them."""
    code = ct.compile(zero(gpt, 2, stage=3)).ranks[0]
    gathers = [i for i, ins in enumerate(code) if isinstance(ins, AllGather)
               and not is_regather(ins)]  # the forward's (test_reshard: the backward's)
    waits = {ins.handle: i for i, ins in enumerate(code) if isinstance(ins, Wait)}
    units = [{".".join(k.tensor.split(".")[:2 if k.tensor.startswith("h.") else 1])
              for k in code[i].keys} for i in gathers]
    assert units == [{"wte"}, {"wpe"}, {"h.0"}, {"h.1"}, {"ln_f"}]
    gathered = sorted(k.tensor for i in gathers for k in code[i].keys)
    assert gathered == sorted(gpt.params) and all(code[i].handle for i in gathers)
    hidden = [i for i in gathers if any(isinstance(ins, Forward) and any(ins.grad)
                                        for ins in code[i:waits[code[i].handle]])]
    assert len(hidden) >= len(gathers) - 1  # all but the first piece's
