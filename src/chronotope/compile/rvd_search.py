"""The cheapest way from one RVD layout to another: Dijkstra over collectives.

A step moves a factor of the layout from one axis to another: a value split
becomes replicas (all-reduce) or a dim split (reduce-scatter), a dim split
becomes replicas (all-gather) or another dim's split (all-to-all), replicas
become a dim split (each keeps its chunk) or a value split (one keeps the
value, the others zeros). The members of each group differ only in the moved
digit. Between device sets (a pipeline boundary, another mesh), messages move
the pieces onto the other set as they are, one piece to several devices
(scatter) or several pieces to one (gather). From every layout, plain messages
to the target are one more edge, so the search is never worse than sending
point to point, and reaches any device order. (Messages to the target leave from the
source, from layouts of the target's RVD in another device order, and from the
other device set.) Edge weights are seconds from
the cost model (``cost.network``).

``run_path`` carries a path out on one rank with the runtime's transports
(threads, or torch.distributed on gloo and NCCL).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from chronotope.compile.rvd import RVD, Layout
from chronotope.cost.network import Cluster, load_cluster
from chronotope.errors import PlanError
from chronotope.graph.mask import Index, Mask

R, V = 0, 1  # axes of the radix (r, v, d1..dn); dim i is axis 2 + i
COLLECTIVE_STEPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    box: Index  # the region sent, in the whole tensor's coordinates

    def moved(self, by: int) -> Message:
        return Message(self.src + by, self.dst + by, self.box)


@dataclass(frozen=True)
class Step:
    """One layout change: ``kind`` over ``groups`` (members in digit order), or messages."""

    kind: str  # a COLLECTIVE_STEPS kind, "chunk", "zeros" or "send"
    before: Layout
    after: Layout
    seconds: float
    groups: tuple[tuple[int, ...], ...] = ()
    dims: tuple[int, ...] = ()  # gathered / scattered / chunked dim; all-to-all: (cat, split)
    messages: tuple[Message, ...] = ()

    def __str__(self) -> str:
        if self.kind == "send":
            moved = sum(1 for m in self.messages if m.src != m.dst)
            return f"send({moved} messages)" if moved else "local"
        dims = f"dim {self.dims[0]}->{self.dims[1]}" if self.kind == "all_to_all" else \
            f"dim {self.dims[0]}" if self.dims else ""
        what = f"{len(self.groups)}x{len(self.groups[0])}"
        return f"{self.kind.replace('_', '-')}({', '.join(x for x in (dims, what) if x)})"

    def moved(self, by: int) -> Step:
        return replace(self, before=self.before.moved(by), after=self.after.moved(by),
                       groups=tuple(tuple(d + by for d in g) for g in self.groups),
                       messages=tuple(m.moved(by) for m in self.messages))


@dataclass(frozen=True)
class Path:
    src: Layout
    dst: Layout
    steps: tuple[Step, ...] = field(default=())

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    def groups(self) -> list[tuple[int, ...]]:
        """Every collective group the path uses (torch.distributed makes them up front)."""
        return sorted({g for s in self.steps if s.kind in COLLECTIVE_STEPS for g in s.groups})

    def __str__(self) -> str:
        return " > ".join(map(str, self.steps)) or "nothing to do"

    def describe(self) -> str:
        """The steps with the layout after each."""
        return " > ".join([str(self.src.rvd), *(f"{s} {s.after.rvd}" for s in self.steps)])

    def moved(self, by: int) -> Path:
        """The same path between devices ``by`` further on (on a cluster of nodes alike, by
        whole nodes, it costs the same)."""
        return Path(self.src.moved(by), self.dst.moved(by), tuple(s.moved(by) for s in self.steps))


def normal(layout: Layout) -> Layout:
    """The same pieces on the same devices, replicas in device order: one key per state."""
    rest = layout.rvd.ndevices // layout.rvd.r  # the replica digit is the slowest
    columns = [sorted(layout.devices[i::rest]) for i in range(rest)]
    return Layout(layout.rvd, tuple(col[k] for k in range(layout.rvd.r) for col in columns))


# ---- steps -------------------------------------------------------------------------------------


def _move(layout: Layout, a: int, b: int, f: int, a_high: bool, b_high: bool,
          ) -> tuple[RVD, tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Move a factor ``f`` of axis ``a`` to axis ``b``: the new RVD, its devices in
    canonical order, and the groups of devices that differ only in the moved digit."""
    radix = list(layout.rvd.radix)
    na, nb = radix[a], radix[b]
    new = radix.copy()
    new[a], new[b] = na // f, nb * f
    devices = [0] * layout.rvd.ndevices
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for device, digits in zip(layout.devices, itertools.product(*(range(n) for n in radix))):
        x = list(digits)
        g, rest = (x[a] // (na // f), x[a] % (na // f)) if a_high else (x[a] % f, x[a] // f)
        x[a] = rest
        key = tuple(x)
        x[b] = g * nb + x[b] if b_high else x[b] * f + g
        flat = 0
        for digit, size in zip(x, new):
            flat = flat * size + digit
        devices[flat] = device
        groups.setdefault(key, []).append((g, device))
    members = tuple(tuple(d for _, d in sorted(m)) for m in groups.values())
    return RVD(new[0], new[1], tuple(new[2:])), tuple(devices), members


_KIND = {  # (from axis, to axis) class -> step kind
    ("V", "R"): "all_reduce", ("D", "R"): "all_gather", ("V", "D"): "reduce_scatter",
    ("D", "D"): "all_to_all", ("R", "D"): "chunk", ("R", "V"): "zeros",
}


def _cls(axis: int) -> str:
    return "R" if axis == R else "V" if axis == V else "D"


def _piece_bytes(layout: Layout, shape: tuple[int, ...], itemsize: int) -> float:
    return math.prod(shape) / math.prod(layout.rvd.d) * itemsize


def intra_steps(layout: Layout, shape: tuple[int, ...], itemsize: int,
                cluster: Cluster, dims: frozenset[int] | None = None) -> list[Step]:
    """Every one-collective (or local) layout change over the same devices (splitting
    only ``dims``, if given)."""
    radix = layout.rvd.radix
    out = []
    for a, b in itertools.permutations(range(len(radix)), 2):
        kind = _KIND.get((_cls(a), _cls(b)))
        if kind is None or (dims is not None and b >= 2 and b - 2 not in dims):
            continue
        for f in _divisors(radix[a]):
            if b >= 2 and shape[b - 2] % (radix[b] * f):
                continue
            for a_high in ((False, True) if a == R else (False,)):
                for b_high in ((False, True) if b == R else (False,)):
                    rvd, devices, groups = _move(layout, a, b, f, a_high, b_high)
                    after = normal(Layout(rvd, devices))
                    moved = (b - 2,) if kind in ("reduce_scatter", "chunk") else \
                        (a - 2,) if kind == "all_gather" else \
                        (a - 2, b - 2) if kind == "all_to_all" else ()
                    seconds = _step_seconds(kind, layout, after, groups, shape, itemsize, cluster)
                    out.append(Step(kind, layout, after, seconds, groups, moved))
    return out


def _step_seconds(kind: str, before: Layout, after: Layout, groups, shape, itemsize: int,
                  cluster: Cluster) -> float:
    if kind in ("chunk", "zeros"):
        return cluster.copy(_piece_bytes(after, shape, itemsize))
    held = _piece_bytes(after if kind == "all_gather" else before, shape, itemsize)
    return cluster.collective(kind, held, list(groups))


def _divisors(n: int) -> list[int]:
    return [f for f in range(2, n + 1) if n % f == 0]


def send_step(before: Layout, after: Layout, shape: tuple[int, ...], itemsize: int,
              cluster: Cluster) -> Step:
    """Plain messages that make ``after`` from ``before``: each region a device needs
    comes from a device holding it (itself, else one on its node, else the least busy);
    value parts finer than needed are summed, a coarser part goes whole to the first of
    the parts it is cut into (the others start from zeros)."""
    held: dict[tuple, list[int]] = {}
    for device, mask in _pieces(before, shape):  # value parts as floats: i/v compare exactly
        held.setdefault((mask.index, float(mask.value.lo), float(mask.value.hi)),
                        []).append(device)
    sent: dict[int, float] = {}
    messages = []
    ordered = sorted(held.items())
    for dst, need in sorted(_pieces(after, shape), key=lambda p: p[0]):
        nlo, nhi = float(need.value.lo), float(need.value.hi)
        for (index, vlo, vhi), devices in ordered:
            box = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(index, need.index))
            if any(lo >= hi for lo, hi in box) or vhi <= nlo or nhi <= vlo:
                continue
            coarser = vlo <= nlo and nhi <= vhi
            if not (coarser or (nlo <= vlo and vhi <= nhi)):
                raise PlanError(f"value parts of {before.rvd} and {after.rvd} do not nest: "
                                f"[{vlo:g}, {vhi:g}) against [{nlo:g}, {nhi:g})")
            if coarser and vlo != nlo:
                continue  # a later part of a whole value: zeros
            src = _nearest(dst, devices, sent, cluster)
            nbytes = math.prod(hi - lo for lo, hi in box) * itemsize
            sent[src] = sent.get(src, 0.0) + (nbytes if src != dst else 0.0)
            messages.append(Message(src, dst, box))
    seconds = cluster.transfer([(m.src, m.dst, math.prod(b - a for a, b in m.box) * itemsize)
                                for m in messages])
    local = sum(math.prod(b - a for a, b in m.box) for m in messages if m.src == m.dst)
    return Step("send", before, normal(after), seconds + cluster.copy(local * itemsize),
                messages=tuple(messages))


@lru_cache(maxsize=65536)
def _pieces(layout: Layout, shape: tuple[int, ...]) -> list[tuple[int, Mask]]:
    return layout.pieces(shape)


def _nearest(dst: int, devices: list[int], sent: dict[int, float], cluster: Cluster) -> int:
    if dst in devices:
        return dst
    return min(devices, key=lambda d: (cluster.node(d) != cluster.node(dst), sent.get(d, 0.0),
                                      -cluster.link(d, dst).bandwidth, d))


def cross_layouts(layout: Layout, devices: tuple[int, ...], target: Layout,
                  shape: tuple[int, ...]) -> list[Layout]:
    """Layouts on another device set one set of messages reaches: the same RVD (a move),
    a factor more replicas or dim splits (scatter), or one less of any axis (gather).
    Devices in sorted order, or the target's where the RVD is the target's."""
    n, m = layout.rvd.ndevices, len(devices)
    radix = layout.rvd.radix
    options = []
    if n == m:
        options.append(radix)
    elif m % n == 0:
        k = m // n
        options += [_times(radix, axis, k) for axis in range(len(radix)) if axis != V
                    and (axis == R or shape[axis - 2] % (radix[axis] * k) == 0)]
    elif n % m == 0:
        k = n // m
        options += [_times(radix, axis, 1, k) for axis in range(len(radix))
                    if radix[axis] % k == 0]
    out = []
    for new in options:
        rvd = RVD(int(new[0]), int(new[1]), tuple(int(x) for x in new[2:]))
        out.append(Layout(rvd, tuple(sorted(devices))))
        if rvd == target.rvd and tuple(sorted(devices)) != target.devices:
            out.append(target)
    return out


def _times(radix: tuple[int, ...], axis: int, times: int, over: int = 1) -> tuple[int, ...]:
    """``radix`` with digit ``axis`` multiplied by ``times / over`` (exactly divisible)."""
    return tuple(x * times // over if i == axis else x for i, x in enumerate(radix))


# ---- search ------------------------------------------------------------------------------------


def search(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int = 4,
           cluster: Cluster | str = "dgx1-v100", max_states: int = 20000) -> Path:
    """The cheapest path from ``src`` to ``dst`` under ``cluster``'s cost model."""
    cluster = load_cluster(cluster) if isinstance(cluster, str) else cluster
    for layout in (src, dst):
        _check(layout, shape, cluster)
    start, goal = normal(src), normal(dst)
    # Dims to split on the way: those either end splits, and the longest (to cut what is
    # replicated into runs that travel once).
    dims = frozenset(i for i in range(len(shape)) if src.rvd.d[i] > 1 or dst.rvd.d[i] > 1)
    dims |= {max(range(len(shape)), key=lambda i: shape[i])} if shape else set()
    goal_set = frozenset(goal.devices)
    best = {start: 0.0}
    came: dict[Layout, tuple[Layout, Step]] = {}
    tie = itertools.count()
    heap = [(0.0, next(tie), start)]
    done = set()
    while heap:
        cost, _, state = heapq.heappop(heap)
        if state == goal:
            steps = []
            while state != start:
                state, step = came[state]
                steps.append(step)
            return Path(src, dst, tuple(reversed(steps)))
        if state in done:
            continue
        done.add(state)
        if len(done) > max_states:
            break
        for step in _edges(state, start, goal, goal_set, shape, itemsize, cluster, dims):
            new = cost + step.seconds + 1e-9  # fewer steps among equals
            if new < best.get(step.after, math.inf):
                best[step.after] = new
                came[step.after] = (state, step)
                heapq.heappush(heap, (new, next(tie), step.after))
    return p2p(src, dst, shape, itemsize, cluster)


def _edges(state: Layout, start: Layout, goal: Layout, goal_set: frozenset, shape,
           itemsize: int, cluster: Cluster, dims: frozenset[int]) -> list[Step]:
    out = intra_steps(state, shape, itemsize, cluster, dims)
    if frozenset(state.devices) != goal_set:
        out += [send_step(state, nxt, shape, itemsize, cluster)
                for nxt in cross_layouts(state, tuple(goal_set), goal, shape)
                if nxt != goal and all(k == 1 or i in dims for i, k in enumerate(nxt.rvd.d))]
    if state == start or state.rvd == goal.rvd or frozenset(state.devices) != goal_set:
        try:  # plain messages: the whole way, the last move, or across device sets
            out.append(send_step(state, goal, shape, itemsize, cluster))
        except PlanError:
            pass  # value parts that do not nest: collectives must first change them
    return out


def p2p(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int = 4,
        cluster: Cluster | str = "dgx1-v100") -> Path:
    """The naive way: one set of point-to-point messages."""
    cluster = load_cluster(cluster) if isinstance(cluster, str) else cluster
    return Path(src, dst, (send_step(src, dst, shape, itemsize, cluster),))


def _check(layout: Layout, shape: tuple[int, ...], cluster: Cluster) -> None:
    if len(set(layout.devices)) != len(layout.devices):
        raise PlanError(f"layout {layout.rvd} on devices {list(layout.devices)} puts two pieces "
                        f"on one device")
    outside = [d for d in layout.devices if not 0 <= d < cluster.ndevices]
    if outside:
        nodes = 1 + max(outside) // cluster.per_node
        raise PlanError(f"devices {outside} of layout {layout.rvd} are not in cluster "
                        f"{cluster.name} ({cluster.ndevices} devices): pick a larger cluster "
                        f"(e.g. {cluster.name.split('x')[0]}x{nodes})")
    layout.pieces(shape)  # dims that do not divide raise here
