"""Communication cost: alpha-beta per collective and per link class, on a named cluster.

A message of ``n`` bytes over a link costs ``alpha + n / bandwidth``. Collectives
run as rings over their group (NCCL's and gloo's default for large messages):
``k`` members take ``k - 1`` steps (twice for an all-reduce), each moving
``1/k`` of the data over the ring's slowest link. A ring inside a node finds
the best cycle through the node's links (on a DGX-1 some pairs share two
NVLinks, some one, some none); a ring across nodes crosses each node's network
once, whose bandwidth the groups crossing it at the same time share.

A cluster is a preset (``dgx1-v100``, ``dgx-a100``, ``h100-sxm``, with ``xN``
for N nodes of it) or a profile file ``chronotope profile`` measured, whose
fitted alpha and bandwidth per collective replace the link model (fitted twice:
calls back to back, and calls after a stretch of compute, between which a call
is priced by the compute before it).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

from chronotope.errors import ChronotopeError
from chronotope.graph.autocast import DTYPES

KINDS = ("send", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


class ClusterError(ChronotopeError):
    """An unknown cluster preset, or a profile file that cannot be read."""


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message (latency)
    bandwidth: float  # bytes per second, one direction

    def seconds(self, kind: str, k: int, nbytes: float) -> float:
        """A ring collective ``kind`` over ``k`` members (or a message) on this link."""
        steps, volume = steps_and_volume(kind, k)
        return steps * self.alpha + nbytes * volume / self.bandwidth


def steps_and_volume(kind: str, k: int) -> tuple[float, float]:
    """How many latencies and what share of the bytes a ring collective over ``k``
    members pays: ``alpha * steps + nbytes * volume / bandwidth``. ``nbytes`` is what
    each member holds before (all-reduce, reduce-scatter, all-to-all, broadcast) or
    after (all-gather)."""
    if kind == "send":
        return 1.0, 1.0
    if k <= 1:
        return 0.0, 0.0
    if kind == "all_reduce":
        return 2.0 * (k - 1), 2.0 * (k - 1) / k
    if kind == "broadcast":
        return float(k - 1), 1.0  # pipelined along the ring
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(k - 1), (k - 1) / k
    raise ClusterError(f"unknown collective {kind!r}; known: {', '.join(KINDS)}")


@dataclass(frozen=True)
class Cluster:
    """Devices ``0 .. nodes * per_node - 1``, node-major, and what connects them."""

    name: str
    nodes: int
    per_node: int
    flops: dict[str, float]  # peak FLOP/s of one device per dtype name
    memory: float  # bytes of one device
    copy_bandwidth: float  # bytes/s read from and written to one device's memory
    intra: Link  # two devices of a node, unless ``pairs`` says otherwise
    inter: Link  # one node's network to the others (all its NICs together)
    pairs: dict[tuple[int, int], Link] = field(default_factory=dict)  # local indices a < b
    fitted: dict[str, Link] = field(default_factory=dict)  # measured, per collective kind
    call: float = 0.0  # seconds to start one collective, message batch or copy (a launch)
    # Measured again with ``busy`` seconds of compute before each call: on CPUs a call
    # made after compute waits longer for cores and caches than one made back to back.
    fitted_busy: dict[str, Link] = field(default_factory=dict)
    busy: float = 0.0
    # The share of communication that runs beside a device's compute at no cost to it: 1
    # where links and compute are apart (GPUs' copy engines and NICs), less on CPUs, where
    # a collective takes the cores the compute runs on (``chronotope profile`` measures it).
    overlap: float = 1.0
    # Bytes/s between one device and host memory, each way (its PCIe link): what swapping
    # saved activations out and back costs; 0 where not known (nothing is swapped).
    host_bandwidth: float = 0.0
    # The share of ``flops`` that the dense matmuls of a training step reach: a datasheet's
    # peak is never reached (1 for a profile, whose rate is a measured matmul's).
    efficiency: float = 1.0

    def __hash__(self) -> int:  # the dict fields aside: a cluster keys search caches
        return hash((self.name, self.nodes, self.per_node, self.intra, self.inter))

    @property
    def ndevices(self) -> int:
        return self.nodes * self.per_node

    def node(self, device: int) -> int:
        return device // self.per_node

    def peak(self, dtype: str = "fp32") -> float:
        """FLOP/s of one device computing in ``dtype`` ("fp32", "bf16", "fp16" or torch's
        names): the tensor cores' rate for 16 bits."""
        name = str(DTYPES[dtype]).removeprefix("torch.") if dtype in DTYPES else dtype
        return self.flops.get(name, self.flops.get("float32", min(self.flops.values())))

    def compute(self, flops: float, nbytes: float, dtype: str = "fp32") -> float:
        """Seconds of a kernel doing ``flops`` and moving ``nbytes`` to and from the device's
        memory: the slower of the two (a roofline). A matmul is bound by its FLOPs, a norm,
        an activation or a softmax by its bytes."""
        return max(flops / (self.peak(dtype) * self.efficiency), nbytes / self.copy_bandwidth)

    def link(self, a: int, b: int) -> Link:
        if self.node(a) != self.node(b):
            return self.inter
        la, lb = sorted((a % self.per_node, b % self.per_node))
        return self.pairs.get((la, lb), self.intra)

    def ring(self, group: tuple[int, ...], sharing: int = 1) -> Link:
        """The ring a collective over ``group`` runs on: its slowest link, and the
        largest latency on it. ``sharing`` groups cross the node networks at once."""
        nodes: dict[int, list[int]] = {}
        for d in group:
            nodes.setdefault(self.node(d), []).append(d % self.per_node)
        inner = [_best_ring(tuple(sorted(ds)), self._table) for ds in nodes.values()
                 if len(ds) > 1]
        links = [Link(a, b) for a, b in inner]
        if len(nodes) > 1:
            links.append(Link(self.inter.alpha, self.inter.bandwidth / max(1, sharing)))
        if not links:
            return Link(0.0, math.inf)
        return Link(max(x.alpha for x in links), min(x.bandwidth for x in links))

    def __post_init__(self) -> None:  # the links of one node, as a hashable table
        n = self.per_node
        table = tuple(tuple(self.link(a, b).alpha if a != b else 0.0 for b in range(n))
                      for a in range(n)), tuple(
            tuple(self.link(a, b).bandwidth if a != b else math.inf for b in range(n))
            for a in range(n))
        object.__setattr__(self, "_table", table)

    def collective(self, kind: str, nbytes: float, groups: list[tuple[int, ...]],
                   busy: float = 0.0) -> float:
        """Seconds for ``groups`` each running the collective at once on ``nbytes`` per
        member, after ``busy`` seconds of compute (for profiled clusters)."""
        crossing: dict[int, int] = {}
        for g in groups:
            if len({self.node(d) for d in g}) > 1:
                for n in {self.node(d) for d in g}:
                    crossing[n] = crossing.get(n, 0) + 1
        worst = None
        for g in groups:
            if len(g) < 2:
                continue
            if kind in self.fitted and self._fits(g):
                seconds = self.measured(kind, nbytes, len(g), busy)
            else:
                share = max((crossing.get(self.node(d), 1) for d in g), default=1)
                seconds = self.ring(tuple(g), share).seconds(kind, len(g), nbytes)
            worst = seconds if worst is None else max(worst, seconds)
        return 0.0 if worst is None else worst + self.call

    def measured(self, kind: str, nbytes: float, k: int, busy: float = 0.0) -> float:
        """Seconds of a profiled call over ``k`` members, made after ``busy`` seconds of
        compute: between the back-to-back and the after-compute fits."""
        back_to_back = self.fitted[kind].seconds(kind, k, nbytes)
        if kind not in self.fitted_busy or self.busy <= 0:
            return back_to_back
        w = min(1.0, busy / self.busy)
        return (1 - w) * back_to_back + w * self.fitted_busy[kind].seconds(kind, k, nbytes)

    def _fits(self, group: tuple[int, ...]) -> bool:
        """Measured fits describe the profiled machine: groups within one of its nodes."""
        return len({self.node(d) for d in group}) == 1

    def transfer(self, messages: list[tuple[int, int, float]]) -> float:
        """Seconds for point-to-point messages ``(src, dst, nbytes)`` sent at once: each
        device sends and receives one message at a time per link, each node's network
        carries what crosses it, and the slowest of those finishes last."""
        busy: dict[tuple, float] = {}
        count: dict[tuple, int] = {}
        for src, dst, nbytes in messages:
            if src == dst or nbytes == 0:
                continue
            link = self.fitted.get("send") if "send" in self.fitted and \
                self.node(src) == self.node(dst) else self.link(src, dst)
            for key in (("out", src), ("in", dst)):
                busy[key] = busy.get(key, 0.0) + nbytes / link.bandwidth
                count[key] = count.get(key, 0) + 1
            if self.node(src) != self.node(dst):
                for key in (("net out", self.node(src)), ("net in", self.node(dst))):
                    busy[key] = busy.get(key, 0.0) + nbytes / self.inter.bandwidth
            busy[("pair", src, dst)] = busy.get(("pair", src, dst), 0.0) + nbytes / link.bandwidth
            count[("pair", src, dst)] = count.get(("pair", src, dst), 0) + 1
        if not busy:
            return 0.0
        alpha = max(self.inter.alpha, self.intra.alpha, *(x.alpha for x in self.fitted.values()))
        return max(busy.values()) + alpha * max(count.values()) + self.call

    def copy(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` within one device."""
        return nbytes / self.copy_bandwidth + self.call

    # ---- files ---------------------------------------------------------------------------------

    def to_json(self) -> dict:
        out = asdict(self)
        out["pairs"] = [[a, b, link.alpha, link.bandwidth] for (a, b), link in self.pairs.items()]
        return out

    @staticmethod
    def from_json(data: dict) -> Cluster:
        try:
            return Cluster(
                name=data["name"], nodes=int(data["nodes"]), per_node=int(data["per_node"]),
                flops={k: float(v) for k, v in data["flops"].items()},
                memory=float(data["memory"]), copy_bandwidth=float(data["copy_bandwidth"]),
                intra=Link(**data["intra"]), inter=Link(**data["inter"]),
                pairs={(int(a), int(b)): Link(al, bw) for a, b, al, bw in data.get("pairs", [])},
                fitted={k: Link(**v) for k, v in data.get("fitted", {}).items()},
                call=float(data.get("call", 0.0)),
                fitted_busy={k: Link(**v) for k, v in data.get("fitted_busy", {}).items()},
                busy=float(data.get("busy", 0.0)), overlap=float(data.get("overlap", 1.0)),
                host_bandwidth=float(data.get("host_bandwidth", 0.0)),
                efficiency=float(data.get("efficiency", 1.0)))
        except (KeyError, TypeError, ValueError) as e:
            raise ClusterError(f"not a cluster profile: {e!r} (write one with "
                               f"`chronotope profile --out FILE`)") from e


def _nvlink_cube_mesh() -> dict[tuple[int, int], Link]:
    """DGX-1 with V100: every GPU has six NVLink 2.0 links (25 GB/s each way each) to
    four others, two links to two of them; the other three GPUs are reached through
    PCIe and the CPUs."""
    double = {(0, 3), (0, 4), (1, 2), (1, 5), (2, 3), (4, 7), (5, 6), (6, 7)}
    single = {(0, 1), (0, 2), (1, 3), (2, 6), (3, 7), (4, 5), (4, 6), (5, 7)}
    return {p: Link(3e-6, 50e9 if p in double else 25e9) for p in double | single}


GiB = 1024.0 ** 3
PRESETS: dict[str, Cluster] = {
    "dgx1-v100": Cluster(
        "dgx1-v100", 1, 8, {"float32": 15.7e12, "float16": 125e12, "bfloat16": 125e12},
        32 * GiB, 900e9, intra=Link(8e-6, 10e9), inter=Link(10e-6, 12.5e9),  # 100 Gb/s IB
        pairs=_nvlink_cube_mesh(), call=10e-6, host_bandwidth=12e9),  # PCIe 3.0 x16
    "dgx-a100": Cluster(
        "dgx-a100", 1, 8, {"float32": 19.5e12, "float16": 312e12, "bfloat16": 312e12},
        80 * GiB, 2.0e12, intra=Link(1.5e-6, 300e9), inter=Link(8e-6, 200e9),
        call=10e-6, host_bandwidth=25e9, efficiency=0.8),  # 8 x 200 Gb/s; PCIe 4.0 x16
    "h100-sxm": Cluster(
        "h100-sxm", 1, 8, {"float32": 67e12, "float16": 989e12, "bfloat16": 989e12},
        80 * GiB, 3.35e12, intra=Link(1e-6, 450e9), inter=Link(6e-6, 400e9),
        call=10e-6, host_bandwidth=50e9, efficiency=0.7),  # 8 x 400 Gb/s; PCIe 5.0 x16
}


def cluster_for(ndevices: int, spec: str | None = None) -> Cluster:
    """``spec`` (a preset or a profile file), or DGX A100 nodes enough for ``ndevices``;
    a preset without a node count gets as many nodes as the devices need."""
    cluster = load_cluster(spec or "dgx-a100")
    if spec in PRESETS or spec is None:
        cluster = replace(cluster, name=f"{cluster.name}x{-(-ndevices // cluster.per_node)}",
                          nodes=-(-ndevices // cluster.per_node))
    return cluster


def load_cluster(spec: str) -> Cluster:
    """A preset name, ``NAMExN`` for N nodes of it, or a profile file."""
    if spec.endswith(".json") or os.sep in spec:
        try:
            with open(spec) as f:
                return Cluster.from_json(json.load(f))
        except OSError as e:
            raise ClusterError(f"cannot read the cluster profile {spec}: {e.strerror}") from e
        except json.JSONDecodeError as e:
            raise ClusterError(f"{spec} is not JSON ({e}); write a profile with "
                               f"`chronotope profile --out {spec}`") from e
    match = re.fullmatch(r"(.+?)(?:x(\d+))?", spec)
    name, nodes = match.group(1), int(match.group(2) or 1)
    if name not in PRESETS or nodes < 1:
        raise ClusterError(f"unknown cluster {spec!r}: use one of {', '.join(PRESETS)} "
                           f"(NAMExN for N nodes), or a profile file from `chronotope profile`")
    base = PRESETS[name]
    return replace(base, name=spec, nodes=nodes)


@lru_cache(maxsize=4096)
def _best_ring(devices: tuple[int, ...], table: tuple) -> tuple[float, float]:
    """(alpha, bandwidth) of the cycle through ``devices`` whose slowest link is fastest."""
    alphas, bandwidths = table
    if len(devices) == 2:
        a, b = devices
        return alphas[a][b], bandwidths[a][b]
    first, rest = devices[0], devices[1:]
    best = (math.inf, 0.0)
    if len(rest) > 8:  # too many cycles to try: the plain order
        orders = [rest]
    else:
        orders = (p for p in itertools.permutations(rest) if p[0] < p[-1])
    for order in orders:
        cycle = (first, *order, first)
        bw = min(bandwidths[a][b] for a, b in itertools.pairwise(cycle))
        if bw > best[1]:
            best = (max(alphas[a][b] for a, b in itertools.pairwise(cycle)), bw)
    return best
