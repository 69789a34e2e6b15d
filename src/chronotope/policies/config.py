"""Ready-made plans by name: one typed configuration, checked in one place.

``ParallelConfig`` says which policy and with what (devices, tp, pp, micro-batches,
chunks, activations ...); ``make(graph, config)`` builds the plan. The CLI's
``--policy`` and its options, and anything else that picks a policy by name, go
through here, so an option is read the same way everywhere, and an option the
chosen policy does not read is an error naming it rather than silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from chronotope.errors import PlanError
from chronotope.graph.ir import Graph
from chronotope.plan.pause import collector_paused
from chronotope.plan.plan import Plan
from chronotope.policies.context import VARIANTS
from chronotope.policies.interlaced import interlaced
from chronotope.policies.mesh import mesh
from chronotope.policies.pipeline import (
    MULTI_STAGE,
    SCHEDULES,
    UNFOLDED,
    Order,
    pipeline,
    read_schedule,
)
from chronotope.policies.zero import zero

ACTIVATIONS = ("full", "selective")  # what recompute and swap take


@dataclass(frozen=True)
class ParallelConfig:
    """A policy by name and the options it reads; None (or False): the policy's default.

    ``tp``: the tensor-parallel group of the dp-tp, dp-sp and coshard meshes (default 2)
    and inside each zero-* replica (default 1); ``pp``: pipeline stages (default 1 for
    the meshes, all devices for the pipelines, the rest data parallel); ``micro``:
    micro-batches (default 1 for the meshes; up to 2 per stage for the pipelines, as the
    batch allows); ``chunks``: stages per rank (interleaved, zbv; default 2);
    ``coshard``: pieces per device of each attention and MLP (default 2); ``recompute``
    and ``swap``: "full" or "selective"; ``fold``: plan one micro-batch and run every
    one from it (default: pipelines fold, a mesh's with pp > 1 among them, but for
    co-shard and the schedules that run the model twice a step, chimera and 3f1b);
    ``schedule``: the order of csv's pipeline, or of a family's (in its shape), as a
    torch pipelining CSV file or an ``Order`` (the order search's); ``cp``: the
    context-parallel group of every op along the sequence (the cp policy: default all
    devices over tp x pp; the meshes and pipelines: default 1), ``cp_attention`` how its
    attention meets ("allgather", "ring" or "ulysses", see ``policies/context.py``);
    ``ep``: the data-parallel replicas each Mixture-of-Experts layer's experts are shared
    out over (default 1)."""

    policy: str = "dp"
    devices: int = 1
    tp: int | None = None
    pp: int | None = None
    micro: int | None = None
    chunks: int | None = None
    coshard: int | None = None
    recompute: str | None = None
    swap: str | None = None
    fold: bool | None = None
    schedule: str | Order | None = None
    cp: int | None = None
    cp_attention: str | None = None
    ep: int | None = None

    def given(self) -> dict[str, object]:
        """The options set away from their default (policy and devices aside)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)
                  if f.name not in ("policy", "devices")}
        return {k: v for k, v in values.items() if v is not None}


@dataclass(frozen=True)
class Spelling:
    """How the caller names an option in messages: Python keywords (``tp=4``, the
    default) or command-line flags (``--tp 4``, the CLI's)."""

    flags: bool = False

    def name(self, option: str) -> str:
        return "--" + option.replace("_", "-") if self.flags else option

    def said(self, option: str, value: object) -> str:
        if not self.flags:
            return f"{option}={value!r}"
        if isinstance(value, bool):
            return self.name(option) if value else f"--no-{option.replace('_', '-')}"
        return f"{self.name(option)} {value}"


KEYWORDS, FLAGS = Spelling(), Spelling(flags=True)
Builder = Callable[[Graph, ParallelConfig, Spelling], Plan]
_ACTIVATION_OPTIONS = frozenset({"recompute", "swap"})


def _mesh(sequence: bool = False, coshard: bool = False, context: bool = False) -> Builder:
    def build(graph: Graph, c: ParallelConfig, say: Spelling) -> Plan:
        tp, pp = c.tp or (1 if context else 2), c.pp or 1
        cp = c.cp or (c.devices // (tp * pp) if context else 1)
        if c.devices % (tp * pp * cp) or not cp:
            given = " x ".join(say.said(k, v) for k, v in (("tp", tp), ("pp", pp), ("cp", cp))
                               if k != "cp" or c.cp)
            raise PlanError(f"{given} does not divide {say.said('devices', c.devices)}: a "
                            "mesh needs devices = dp * pp * cp * tp")
        return mesh(graph, c.devices // (tp * pp * cp), tp, pp=pp, micro=c.micro or 1,
                    sequence=sequence, coshard=(c.coshard or 2) if coshard else 1,
                    fold=c.fold if c.fold is not None else pp > 1 and not coshard,
                    recompute=c.recompute, swap=c.swap, cp=cp,
                    cp_attention=c.cp_attention or "allgather", ep=c.ep or 1)
    return build


def _flat(**kinds: bool) -> Builder:
    """dp, tp or sp over all devices."""
    def build(graph: Graph, c: ParallelConfig, say: Spelling) -> Plan:
        if kinds.get("dp"):
            return mesh(graph, dp=c.devices, recompute=c.recompute, swap=c.swap, ep=c.ep or 1)
        return mesh(graph, tp=c.devices, sequence=kinds.get("sequence", False),
                    recompute=c.recompute, swap=c.swap)
    return build


def _pipeline(schedule: str) -> Builder:
    def build(graph: Graph, c: ParallelConfig, say: Spelling) -> Plan:
        cp = c.cp or 1
        stages = c.pp if c.pp and c.pp > 1 else c.devices // cp
        if c.devices % (stages * cp) or not stages:
            raise PlanError(f"{say.said('pp', stages)} stages"
                            f"{' x ' + say.said('cp', cp) if cp > 1 else ''} do not divide "
                            f"{say.said('devices', c.devices)}: a pipeline needs devices = "
                            "dp * stages * cp")
        dp = c.devices // (stages * cp)
        chunks = (c.chunks or 2) if schedule in MULTI_STAGE else 1
        fold = c.fold if c.fold is not None else schedule not in UNFOLDED
        return pipeline(graph, stages, _micro(graph, c, stages, dp), _order(c, schedule, say),
                        dp=dp,
                        chunks=chunks, fold=fold, recompute=c.recompute, swap=c.swap, cp=cp,
                        cp_attention=c.cp_attention or "allgather", ep=c.ep or 1)
    return build


def _order(c: ParallelConfig, family: str, say: Spelling) -> str | Order:
    """The family's own order, or the one ``schedule`` writes down in its shape."""
    if c.schedule is None:
        return family
    if isinstance(c.schedule, Order):
        if c.schedule.family != family:
            raise PlanError(f"the order {say.name('schedule')} gives is one of the "
                            f"{c.schedule.family} pipeline and cannot run as {family}: give "
                            f"policy {c.schedule.family}")
        return c.schedule
    try:
        return Order(family, read_schedule(c.schedule)[1])
    except PlanError as e:  # (its message starts with the file's name)
        raise PlanError(f"{say.name('schedule')} {e}") from e


def _interlaced(graph: Graph, c: ParallelConfig, say: Spelling) -> Plan:
    """The shared embedding on every rank, the rest in 1F1B stages over all devices."""
    return interlaced(graph, c.devices, _micro(graph, c, c.devices, 1))


def _micro(graph: Graph, c: ParallelConfig, stages: int, dp: int) -> int:
    """``micro`` when given, else up to two per stage, as many as each group's batch
    allows."""
    if c.micro is not None:
        return c.micro
    batch = graph.batch_size // dp if graph.batch_size else 1
    return max(m for m in range(1, 2 * stages + 1) if batch % m == 0)


def _zero(stage: int) -> Builder:
    def build(graph: Graph, c: ParallelConfig, say: Spelling) -> Plan:
        return zero(graph, c.devices, stage, tp=c.tp or 1)
    return build


def _csv(graph: Graph, c: ParallelConfig, say: Spelling) -> Plan:
    """A pipeline in the order of a torch pipelining CSV: its rows are the stage ranks,
    its stages and micro-batches size the plan."""
    if not c.schedule:
        raise PlanError(f"csv needs {say.said('schedule', 'FILE.csv')}: a torch "
                        "pipelining CSV file, one row of actions such as 0F1, 0B0 per "
                        "pipeline rank")
    if isinstance(c.schedule, Order):
        raise PlanError(f"csv reads a CSV file; an order of the {c.schedule.family} pipeline "
                        f"runs with policy {c.schedule.family}")
    schedule, rows = read_schedule(c.schedule)
    ranks = len(rows)
    steps = [step for row in rows.values() for step in row]
    if not steps or c.devices % ranks:
        raise PlanError(f"{c.schedule}: {ranks} pipeline ranks do not divide "
                        f"{say.said('devices', c.devices)}" if steps else
                        f"{c.schedule} has no F or B steps")
    stages = max(s for _, s, _ in steps) + 1
    micro = max(m for _, _, m in steps) + 1
    return pipeline(graph, ranks, micro, schedule, dp=c.devices // ranks,
                    chunks=max(1, stages // ranks), recompute=c.recompute, swap=c.swap)


@dataclass(frozen=True)
class Policy:
    """A ready-made plan: how it is built and which options it reads."""

    build: Builder
    reads: frozenset[str]
    about: str


_CONTEXT = frozenset({"cp", "cp_attention"})
_MESH = frozenset({"tp", "pp", "micro", "fold", "ep"}) | _ACTIVATION_OPTIONS | _CONTEXT
_PIPELINE = frozenset({"pp", "micro", "fold", "ep", "schedule"}) | _ACTIVATION_OPTIONS | \
    _CONTEXT

POLICIES: dict[str, Policy] = {
    "dp": Policy(_flat(dp=True), _ACTIVATION_OPTIONS | {"ep"}, "data parallel"),
    "tp": Policy(_flat(), _ACTIVATION_OPTIONS, "Megatron tensor parallel"),
    "sp": Policy(_flat(sequence=True), _ACTIVATION_OPTIONS, "tensor + sequence parallel"),
    "dp-tp": Policy(_mesh(), _MESH, "a dp x pp x tp mesh"),
    "dp-sp": Policy(_mesh(sequence=True), _MESH, "a dp x pp x tp mesh, sequence parallel"),
    "cp": Policy(_mesh(context=True), _MESH,
                 "context parallel: every op along the sequence, over a dp x pp x cp x tp mesh"),
    "coshard": Policy(_mesh(coshard=True), _MESH - _CONTEXT - {"ep"} | {"coshard"},
                      "dp-tp with several pieces of each attention and MLP per device"),
    "interlaced": Policy(_interlaced, frozenset({"micro"}),
                         "1F1B with the shared embedding on every device"),
    **{f"zero-{s}": Policy(_zero(s), frozenset({"tp"}), f"ZeRO stage {s}") for s in (1, 2, 3)},
    **{name: Policy(_pipeline(name), _PIPELINE | ({"chunks"} if name in MULTI_STAGE else set()),
                    f"the {name} pipeline schedule") for name in SCHEDULES},
    "csv": Policy(_csv, frozenset({"schedule"}) | _ACTIVATION_OPTIONS,
                  "a pipeline in the order of a torch pipelining CSV file"),
}


def make(graph: Graph, config: ParallelConfig, say: Spelling = KEYWORDS) -> Plan:
    """The plan ``config`` names, on ``graph``; a PlanError for an unknown policy, for
    options the policy does not read (naming them), and for values that do not fit.
    ``say``: how messages name an option (``KEYWORDS``: ``tp=4``; the CLI's ``FLAGS``:
    ``--tp 4``)."""
    policy = POLICIES.get(config.policy)
    if policy is None:
        raise PlanError(f"unknown policy {config.policy!r}: choose from "
                        f"{', '.join(POLICIES)}")
    unread = [say.said(k, v) for k, v in config.given().items() if k not in policy.reads]
    if unread:
        reads = ", ".join(map(say.name, sorted(policy.reads))) or "no options"
        raise PlanError(f"policy {config.policy} does not read {', '.join(unread)} (it "
                        f"reads {reads}): leave them out, or choose a policy that uses them")
    for name, allowed in (("recompute", ACTIVATIONS), ("swap", ACTIVATIONS),
                          ("cp_attention", VARIANTS)):
        value = getattr(config, name)
        if value is not None and value not in allowed:
            raise PlanError(f"{say.said(name, value)}: use one of {', '.join(allowed)}")
    with collector_paused():  # (a large plan's pieces: see plan/pause.py)
        return policy.build(graph, config, say)
