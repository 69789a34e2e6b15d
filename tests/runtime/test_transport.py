"""The transports: started calls waited on later, and messages matched as NCCL matches
them (``OrderedTransport``, under which every thread-run test in the suite runs)."""

import threading

import pytest
import torch

from chronotope.runtime.transport import OrderedTransport, OrderError, ThreadTransport

CPU = torch.device("cpu")


def run(*ranks):
    """Each function a thread (its rank is its position); the errors they raised."""
    errors: dict[int, BaseException] = {}

    def work(r, fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            errors[r] = e

    threads = [threading.Thread(target=work, args=(r, fn)) for r, fn in enumerate(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_started_receives_and_collectives_give_their_results_when_waited_on():
    transport = ThreadTransport(timeout=5)
    got = {}

    def rank0():
        pending = transport.recv((2,), torch.float32, 1, 0, tag=7, device=CPU, async_op=True)
        total = transport.all_reduce(torch.ones(2), (0, 1), 0, async_op=True)
        got["message"], got["sum"] = pending.wait(), total.wait()

    def rank1():
        transport.send(torch.tensor([3.0, 4.0]), 1, 0, tag=7)
        transport.all_reduce(torch.ones(2) * 2, (0, 1), 1)

    assert not run(rank0, rank1)
    assert got["message"].tolist() == [3.0, 4.0]
    assert got["sum"].tolist() == [3.0, 3.0]


def test_receives_take_the_messages_in_the_order_they_were_posted_not_waited():
    transport = OrderedTransport(timeout=5)
    got = []

    def rank0():
        first = transport.recv((), torch.float32, 1, 0, tag=1, device=CPU, async_op=True)
        second = transport.recv((), torch.float32, 1, 0, tag=2, device=CPU, async_op=True)
        got.extend([second.wait().item(), first.wait().item()])

    def rank1():
        transport.send(torch.tensor(1.0), 1, 0, tag=1)
        transport.send(torch.tensor(2.0), 1, 0, tag=2)

    assert not run(rank0, rank1)
    assert got == [2.0, 1.0]


def test_a_receive_posted_out_of_the_senders_order_is_named():
    """Tags would match these up; NCCL matches by order and would swap the two payloads."""
    transport = OrderedTransport(timeout=5)

    def rank0():
        transport.recv((), torch.float32, 1, 0, tag=2, device=CPU)

    def rank1():
        transport.send(torch.tensor(1.0), 1, 0, tag=1)
        transport.send(torch.tensor(2.0), 1, 0, tag=2)

    errors = run(rank0, rank1)
    assert any(isinstance(e, OrderError) for e in errors.values()), errors
    assert "message 2" in str(next(e for e in errors.values() if isinstance(e, OrderError)))


def test_two_ranks_that_order_their_messages_to_each_other_differently_are_named():
    """Each sends first, then receives: on one NCCL stream per pair both sends wait on
    receives posted behind them."""
    transport = OrderedTransport(timeout=5)

    def rank(me, peer):
        def fn():
            transport.send(torch.tensor(float(me)), me, peer, tag=10 + me)
            transport.recv((), torch.float32, peer, me, tag=10 + peer, device=CPU)
        return fn

    errors = run(rank(0, 1), rank(1, 0))
    error = next(e for e in errors.values() if isinstance(e, OrderError))
    assert "order their messages differently" in str(error)


def test_members_calling_different_collectives_at_one_place_are_named():
    transport = ThreadTransport(timeout=5)
    errors = run(lambda: transport.all_reduce(torch.ones(2), (0, 1), 0),
                 lambda: transport.all_gather(torch.ones(2), (0, 1), 1))
    error = next(e for e in errors.values() if isinstance(e, OrderError))
    assert "all-reduce" in str(error) and "all-gather" in str(error)


@pytest.mark.parametrize("transport", [ThreadTransport, OrderedTransport])
def test_a_message_never_sent_times_out_naming_the_sender(transport):
    t = transport(timeout=0.2)
    errors = run(lambda: t.recv((), torch.float32, 1, 0, tag=3, device=CPU), lambda: None)
    assert "from rank 1" in str(errors[0])
