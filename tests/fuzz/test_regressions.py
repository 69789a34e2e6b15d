"""Plans the fuzzer found trained wrong, refused without a name, or compiled into a program
that waits forever, each shrunk to what it takes."""

from collections.abc import Callable

import pytest

import chronotope as ct
from chronotope.runtime.local import run_in_threads
from chronotope.runtime.reference import compare
from tests.fuzz.families import OPTIM, family, reference


def trains_like_one_device(name: str, ndevices: int, build: Callable[[ct.Plan], None],
                           steps: int = 2) -> None:
    """``build`` places what it cuts; every other op runs whole on device 0."""
    workload, graph = family(name)
    plan = ct.Plan(graph, ndevices)
    build(plan)
    for leaf in plan.forward_leaves():
        if leaf.device is None:
            plan.assign(leaf, 0)
    run = run_in_threads(ct.compile(plan), workload, steps, OPTIM, timeout=30)
    diff = compare(run, reference(name, steps))
    assert diff.within(1e-5), diff


def place(plan: ct.Plan, pieces: list, devices: list[int]) -> None:
    for piece, device in zip(pieces, devices, strict=True):
        plan.assign(piece, device)


def partial_sums_read_in_shares(plan: ct.Plan) -> None:
    """A sum cut into three partial sums, read by two halves of a value split on two
    devices: the sender added up two partials and the reader took 3/4 of their total,
    while the other reader took half of one of them (seed 36)."""
    place(plan, plan.trans("sum_1", ct.Split("d0", 3)), [0, 0, 0])
    place(plan, plan.trans("mul", ct.ValueSplit(2)), [0, 1])


def replicated_update_on_one_device(plan: ct.Plan) -> None:
    """Two replicas of a parameter's update on one device stepped it twice (seed 7)."""
    place(plan, plan.trans(plan.update("norm.bias"), ct.Replicate(2)), [1, 1])


def stored_region_overlapping_an_owned_one(plan: ct.Plan) -> None:
    """A device stores the columns a piece reads and updates rows of the same weight: the
    rows' share of the columns was never refreshed after the step (seed 7)."""
    first, second, third = plan.trans("linear", ct.Replicate(3))
    place(plan, [first, *plan.trans(second, ct.Split("k", 2)), third], [0, 0, 2, 0])
    place(plan, plan.trans(plan.update("patch_embed.weight", whole_grad=True),
                           ct.Split("d0", 2)), [2, 0])


def recycled_parameter_under_two_cuts(plan: ct.Plan) -> None:
    """A linear that also runs in a detached recycling pass, cut along its reduction and
    again along its outputs: its bias's gradient shares counted the pass that makes no
    gradient, so the readers summed both cuts' copies of it (seed 21)."""
    halves = plan.trans("linear_82", ct.Split("k", 2))
    plan.trans(halves[0], ct.Split("n", 2))


def replicas_cut_differently(plan: ct.Plan) -> None:
    """One replica of a piece cut in four: its gradients were summed with the other
    replica's whole ones (seed 39)."""
    first, _ = plan.trans("linear_2", ct.Split("b0", 2))
    one, _ = plan.trans(first, ct.Replicate(2))
    plan.trans(one, ct.Split("n", 4))


def value_split_with_a_cut_piece(plan: ct.Plan) -> None:
    """Each piece of a value split yields the whole gradient of the input it is linear in
    (a scalar scale); cutting one of them further made readers add both (seed 49)."""
    pieces = plan.trans("mul", ct.ValueSplit(4))
    plan.trans(pieces[3], ct.Split("d0", 2))
    place(plan, plan.trans(plan.update("temperature"), ct.Replicate(2)), [0, 1])


def value_parts_of_two_replicas(plan: ct.Plan) -> None:
    """Two readers of halves of a loss term took one half from a replica's partial sum
    and the other as half of another replica's whole (seed 239)."""
    plan.trans("cross_entropy_1_sum", ct.Split("n", 2))
    cut, whole = plan.trans("cross_entropy_1", ct.Replicate(2))
    place(plan, [*plan.trans(cut, ct.ValueSplit(2)), whole], [0, 1, 0])
    first, second = plan.trans("add", ct.Replicate(2))
    plan.trans(second, ct.ValueSplit(2))
    plan.trans(first, ct.ValueSplit(2))


def local_partial_of_another_replica(plan: ct.Plan) -> None:
    """A reader of a quarter of a sum took the quarter its own device made in one replica
    while the other readers scaled another replica's whole (seed 80)."""
    first, second, _ = plan.trans("cross_entropy_sum", ct.Replicate(3))
    plan.trans(second, ct.Split("n", 4))
    plan.trans(first, ct.Replicate(3))
    cut, other, last = plan.trans("cross_entropy", ct.Replicate(3))
    place(plan, [plan.trans(cut, ct.ValueSplit(4))[3], other, last], [1, 1, 2])


def collectives_in_two_orders(plan: ct.Plan) -> None:
    """Device 0 all-reduced a gradient before reduce-scattering it, the others the other
    way round: one process group met two different collectives (seed 120)."""
    rows = plan.trans("mean", ct.Split("d0", 4))
    place(plan, plan.trans(rows[1], ct.Split("d1", 4)), [1, 2, 3, 0])
    place(plan, plan.trans(rows[2], ct.Replicate(3)), [1, 2, 3])
    place(plan, [rows[0], rows[3]], [0, 0])
    place(plan, plan.trans("sub", ct.Split("d0", 4)), [0, 1, 2, 3])


def replica_chosen_by_listing_order(plan: ct.Plan) -> None:
    """A reader with no replica on its device: the checker and the compiler picked
    different ones, so the checked order deadlocked the program (seed 251)."""
    for name, devices in [("sub", [0, 0, 0]), ("lt_1", [2, 1, 2]), ("view_7", [0, 1, 0]),
                          ("linear_12", [0, 1, 0]), ("add_15", [0, 0, 0])]:
        place(plan, plan.trans(name, ct.Replicate(3)), devices)
    plan.order(plan.group(["linear_12.1", "view_7.2", "sub.0"], "before"),
               plan.group(["add_15.2", "lt_1.1"], "after"))


def partial_sums_of_replicas_cut_two_ways(plan: ct.Plan) -> None:
    """Three replicas of a scalar times a matrix, cut along columns in two and along rows
    in one: the scalar's gradient halves of the first and the second were added, a sum
    over columns to a sum over rows (seed 10504)."""
    first, second, third = plan.trans("mul", ct.Replicate(3))
    place(plan, plan.trans(third, ct.Split("d1", 2)), [0, 0])
    place(plan, plan.trans(first, ct.Split("d1", 2)), [0, 0])
    place(plan, plan.trans(second, ct.Split("d0", 2)), [2, 0])


def value_parts_from_a_replica_and_a_partial_sum(plan: ct.Plan) -> None:
    """Readers of quarters of a projection: the one cut along the sequence read a copy
    whose last columns are partial sums, the others another copy whole, and their
    shares of those columns did not add up (seed 880)."""
    first, _, _ = plan.trans("linear_5", ct.Replicate(3))
    last = plan.trans(first, ct.Split("n", 4))[3]
    plan.trans(last, ct.Split("k", 4))
    quarter = plan.trans("add_3", ct.ValueSplit(4))[0]
    half = plan.trans(quarter, ct.Split("d1", 2))[0]
    plan.trans(half, ct.ValueSplit(3))


def running_sum_of_rows_of_whole_gradients(plan: ct.Plan) -> None:
    """A layer norm cut in halves along the batch, beside a replica of each of its four
    readers: a half's gradient is its rows of four whole gradients made one after another,
    and summing them as they came added the whole gradients into the half (seed 156, an
    evoformer plan)."""
    place(plan, plan.trans("layer_norm", ct.Split("d0", 2)), [1, 0])
    for reader in ["linear", "linear_1", "linear_2", "add_2"]:
        place(plan, plan.trans(reader, ct.Replicate(2)), [0, 1])


@pytest.mark.parametrize("name, ndevices, build", [
    ("mixer", 2, partial_sums_read_in_shares),
    ("swin", 2, replicated_update_on_one_device),
    ("swin", 3, stored_region_overlapping_an_owned_one),
    ("evoformer", 1, recycled_parameter_under_two_cuts),
    ("towers", 2, replicas_cut_differently),
    ("towers", 2, value_split_with_a_cut_piece),
    ("towers", 2, value_parts_of_two_replicas),
    ("towers", 3, partial_sums_of_replicas_cut_two_ways),
    ("bert", 1, value_parts_from_a_replica_and_a_partial_sum),
    ("bert", 3, local_partial_of_another_replica),
    ("bert", 2, running_sum_of_rows_of_whole_gradients),
    ("towers", 4, collectives_in_two_orders),
    ("t5", 3, replica_chosen_by_listing_order),
], ids=lambda x: getattr(x, "__name__", None))
def test_found_plans_train_like_one_device(name, ndevices, build):
    trains_like_one_device(name, ndevices, build)


def test_a_value_split_of_integers_is_refused_by_name():
    """A value share of an index is no index (t5's relative position buckets: seed 108)."""
    _, graph = family("t5")
    plan = ct.Plan(graph, 2)
    with pytest.raises(ct.PlanError, match=r"add_1: ValueSplit.* mul \(torch.int64\)"):
        plan.trans("add_1", ct.ValueSplit(2))
