"""Plan files: a plan's decisions as a versioned, readable JSON file, applied again to a
freshly captured graph through the primitives.

The file holds what the primitives were told, not what they made: per op, how it is
cut (``{"split": "n", "parts": 2}``, ``{"replicate": 4}``, ``{"value_split": 2}``,
nested for cuts of cuts) and where each piece runs; the optimizer steps made ops;
the pieces recomputed, swapped or with a split backward; the groups and orders
(pipeline schedules); the pipeline cells; the scale. Loading calls ``trans``,
``assign``, ``order`` and the rest on a new ``Plan``, so a loaded plan is checked and
compiled like one written by hand, and a file that no longer fits the graph (an op
gone, a shape changed) is refused naming the op.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from chronotope.errors import PlanError
from chronotope.graph.ir import Graph, Op
from chronotope.graph.registry import OpRegistry
from chronotope.plan.algo import Algorithm, Replicate, Split, ValueSplit
from chronotope.plan.plan import BackwardOf, Group, OrderCall, Plan, PlanOp, Ref

FORMAT = "chronotope-plan"
VERSION = 1


# ---- writing -------------------------------------------------------------------------------


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan's decisions, as plain JSON data."""
    groups: dict[int, tuple[str, Group]] = {}

    def ref(r: Ref) -> Any:
        if isinstance(r, (PlanOp, Op)):
            return r.name
        if isinstance(r, str):
            return r
        if isinstance(r, BackwardOf):
            return {"weight" if r.weight else "backward": ref(r.of)}
        if isinstance(r, Group):
            if id(r) not in groups:
                taken = {name for name, _ in groups.values()}
                name, i = r.name, 2
                while name in taken:
                    name, i = f"{r.name}#{i}", i + 1
                groups[id(r)] = (name, r)
            return {"group": groups[id(r)][0]}
        if isinstance(r, Sequence):
            return {"all": [ref(x) for x in r]}
        raise PlanError(f"cannot write {r!r} into a plan file")

    orders = [[ref(o.before), ref(o.after)] for o in plan.orders]
    group_members: dict[str, list[Any]] = {}
    done = 0
    while done < len(groups):  # a group's members may be groups too
        pending = [(n, g) for n, g in list(groups.values()) if n not in group_members]
        for name, group in pending:
            group_members[name] = [ref(m) for m in group.members]
        done = len(group_members)
    roots = [*plan.updates.values(), *plan.roots.values()]
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": plan.graph.name,
        "devices": plan.ndevices,
        "replicas": plan.replicas,
        "shard_optimizer": plan.shard_optimizer,
        "optimizer": plan.optimizer,
        "dtype": plan.dtype,
        "param_storage": plan.param_storage,
        "reshard": plan.reshard,
        "regather": plan.regather,
        "ring": plan.ring,
        "exchanges": {name: list(label) for name, label in plan.exchanges.items()},
        "updates": {param: {"whole_grad": _whole_grad(op)} for param, op in plan.updates.items()},
        "ops": {op.name: {"kind": op.op.kind, "shape": _shape(op.op), **_node(op)}
                for op in roots if op.children or op.device is not None},
        "recompute": _names(plan, plan.recomputed),
        "swap": _names(plan, plan.swapped),
        "split_backward": _names(plan, plan.split),
        "fuse": _fusions(plan),
        "groups": group_members,
        "orders": orders,
        "cells": [[dp, stage, micro, [p.name for p in pieces]]
                  for (dp, stage, micro), pieces in plan.cells.items()],
        "unsplit": {op.name: why for op, why in plan.unsplit.items()},
        "micro": plan.micro,
        "steps": {str(d): [list(step) for step in steps] for d, steps in plan.steps.items()},
    }


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Write ``plan_to_dict(plan)`` as JSON, one decision per line where it fits."""
    data = plan_to_dict(plan)
    lines = ["{"]
    items = list(data.items())
    for i, (key, value) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        if isinstance(value, dict) and value and key in ("ops", "groups", "updates", "unsplit"):
            lines.append(f"  {json.dumps(key)}: {{")
            entries = list(value.items())
            for j, (k, v) in enumerate(entries):
                lines.append(f"    {json.dumps(k)}: {json.dumps(v)}"
                             + ("," if j < len(entries) - 1 else ""))
            lines.append("  }" + comma)
        elif isinstance(value, list) and value and key in ("orders", "cells"):
            lines.append(f"  {json.dumps(key)}: [")
            lines += [f"    {json.dumps(v)}" + ("," if j < len(value) - 1 else "")
                      for j, v in enumerate(value)]
            lines.append("  ]" + comma)
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{comma}")
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _node(op: PlanOp) -> dict[str, Any]:
    """How an op is cut and placed: its algorithm, then its pieces' devices, or each
    piece's own node where pieces are cut again."""
    if not op.children:
        return {"device": op.device}
    assert op.algo is not None
    out = _algo_dict(op.algo)
    if len(op.children) < _parts(op.algo):  # its first piece kept alone (``Plan.template``)
        out["template"] = True
    if all(not c.children for c in op.children):
        out["devices"] = [c.device for c in op.children]
    else:
        out["pieces"] = [_node(c) for c in op.children]
    return out


def _parts(algo: Algorithm) -> int:
    return algo.n if isinstance(algo, Replicate) else algo.parts


def _algo_dict(algo: Algorithm) -> dict[str, Any]:
    if isinstance(algo, Split):
        return {"split": algo.dim, "parts": algo.parts}
    if isinstance(algo, Replicate):
        return {"replicate": algo.n}
    return {"value_split": algo.parts, **({"inputs": list(algo.inputs)} if algo.inputs else {})}


def _shape(op: Op) -> list[int] | None:
    return list(op.outputs[0].shape) if op.outputs else None


def _whole_grad(update: PlanOp) -> bool:
    return any(axis.factors[0].name.startswith("g") for axis in
               (update.op.signature.inputs[0] if update.op.signature else ()))


def _fusions(plan: Plan) -> dict[str, dict[str, Any]]:
    """Each fusion group: its backend and its pieces, in program order."""
    groups: dict[str, dict[str, Any]] = {}
    for op, fusion in plan.fused.items():
        groups.setdefault(fusion.group, {"backend": fusion.backend, "ops": set()})["ops"].add(op)
    return {g: {"backend": e["backend"], "ops": _names(plan, e["ops"])} for g, e in groups.items()}


def _names(plan: Plan, ops: set[PlanOp]) -> list[str]:
    order = {op.name: i for i, op in enumerate(plan.forward_leaves())}
    return sorted((op.name for op in ops), key=lambda n: order.get(n, len(order)))


# ---- reading -------------------------------------------------------------------------------


def load_plan(graph: Graph, path: str | os.PathLike,
              registry: OpRegistry | None = None) -> Plan:
    """The plan file at ``path`` applied to ``graph`` through the primitives (a scaled
    plan's graph is one replica's: see ``replicas_of``)."""
    return plan_from_dict(graph, _read(path), str(path), registry)


def replicas_of(path: str | os.PathLike) -> int:
    """The data-parallel replicas a plan file runs (``plan.scale``): its graph is captured
    on ``1 / replicas`` of the batch."""
    return int(_read(path).get("replicas", 1))


def _read(path: str | os.PathLike) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read plan file {str(path)!r}: {e}") from e


def plan_from_dict(graph: Graph, data: dict[str, Any], source: str = "plan",
                   registry: OpRegistry | None = None) -> Plan:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanError(f"{source} is not a chronotope plan file (no \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise PlanError(f"{source} is a plan file of version {data.get('version')}; this "
                        f"chronotope reads version {VERSION}")
    plan = Plan(graph, int(data["devices"]), optimizer=data.get("optimizer", "adam"),
                dtype=data.get("dtype", "fp32"),
                registry=registry)
    plan.param_storage = data.get("param_storage", "read")
    plan.reshard = bool(data.get("reshard", False))
    plan.regather = bool(data.get("regather", False))
    plan.ring = bool(data.get("ring", False))
    plan.exchanges = {name: tuple(label) for name, label in data.get("exchanges", {}).items()}
    for param, how in data.get("updates", {}).items():
        if param not in graph.params:
            raise PlanError(f"{source}: parameter {param!r} is not in the graph of "
                            f"{graph.name}: the plan was made for another model")
        plan.update(param, whole_grad=bool(how.get("whole_grad")))
    ops = {op.name: op for op in graph.ops}
    for name, entry in data.get("ops", {}).items():
        if name.startswith("update(") and name.endswith(")"):
            root = plan.op(name) if name in plan._by_name else plan.update(name[7:-1])
        else:
            if name not in ops:
                raise PlanError(f"{source}: op {name!r} ({entry.get('kind')}) is not in the "
                                f"graph of {graph.name}: the plan was made for another "
                                "model, or the model changed")
            op = ops[name]
            if op.kind != entry.get("kind") or _shape(op) != entry.get("shape"):
                raise PlanError(
                    f"{source}: op {name!r} is {op.kind} making {tuple(_shape(op) or ())} "
                    f"here; the plan was made for {entry.get('kind')} making "
                    f"{tuple(entry.get('shape') or ())}: the model changed")
            root = plan.op(name)
        _apply(plan, root, entry, source)
    for name in data.get("recompute", []):
        plan.recompute(_op(plan, name, source))
    for name in data.get("swap", []):
        plan.swap(_op(plan, name, source))
    for name in data.get("split_backward", []):
        plan.split_backward(_op(plan, name, source))
    for group, entry in data.get("fuse", {}).items():
        for name in entry["ops"]:
            plan.fuse(_op(plan, name, source), group, entry["backend"])
    groups: dict[str, Group] = {}
    members = data.get("groups", {})

    def ref(r: Any) -> Ref:
        if isinstance(r, str):
            return _op(plan, r, source)
        if isinstance(r, dict) and "group" in r:
            name = r["group"]
            if name not in groups:
                if name not in members:
                    raise PlanError(f"{source}: an order names group {name!r}, which the file "
                                    "does not define")
                groups[name] = plan.group([ref(m) for m in members[name]], name.split("#")[0])
            return groups[name]
        if isinstance(r, dict) and ("backward" in r or "weight" in r):
            of = ref(r.get("backward", r.get("weight")))
            return plan.weight(of) if "weight" in r else plan.backward(of)
        if isinstance(r, dict) and "all" in r:
            return [ref(x) for x in r["all"]]
        raise PlanError(f"{source}: cannot read {r!r} as an op, group or backward")

    for i, (before, after) in enumerate(data.get("orders", [])):
        b, a = ref(before), ref(after)
        plan.leaves(b), plan.leaves(a)  # names that do not resolve fail here
        plan.orders.append(OrderCall(b, a, f"{source}, order {i + 1}"))
    plan.cells = {(dp, stage, micro): [_op(plan, n, source) for n in names]
                  for dp, stage, micro, names in data.get("cells", [])}
    plan.unsplit = {ops[name]: why for name, why in data.get("unsplit", {}).items()
                    if name in ops}
    if data.get("micro", 1) != 1:
        plan.micro_batches(int(data["micro"]), {int(d): [(k, int(s), int(m)) for k, s, m in st]
                                                for d, st in data.get("steps", {}).items()})
    if data.get("replicas", 1) != 1:
        plan.scale(int(data["replicas"]), bool(data.get("shard_optimizer", False)))
    plan.checked = None
    return plan


def _apply(plan: Plan, op: PlanOp, node: Any, source: str) -> None:
    """Cut ``op`` as ``node`` says and place its pieces."""
    if isinstance(node, dict) and not any(k in node for k in ("split", "replicate",
                                                               "value_split")):
        if node.get("device") is not None:
            plan.assign(op, int(node["device"]))
        return
    if isinstance(node, int) or node is None:
        if node is not None:
            plan.assign(op, node)
        return
    algo = _algo(node, op.name, source)
    try:
        pieces = [plan.template(op, algo)] if node.get("template") else plan.trans(op, algo)
    except PlanError as e:
        raise PlanError(f"{source}: {e}") from e
    if "devices" in node:
        if len(node["devices"]) != len(pieces):
            raise PlanError(f"{source}: op {op.name!r} is cut into {len(pieces)} pieces but "
                            f"the file places {len(node['devices'])}")
        for piece, device in zip(pieces, node["devices"]):
            if device is not None:
                plan.assign(piece, int(device))
    else:
        for piece, sub in zip(pieces, node.get("pieces", [])):
            _apply(plan, piece, sub, source)


def _algo(node: dict[str, Any], name: str, source: str) -> Algorithm:
    if "split" in node:
        return Split(str(node["split"]), int(node["parts"]))
    if "replicate" in node:
        return Replicate(int(node["replicate"]))
    if "value_split" in node:
        return ValueSplit(int(node["value_split"]), tuple(node.get("inputs", ())))
    raise PlanError(f"{source}: op {name!r} has no split, replicate or value_split")


def _op(plan: Plan, name: str, source: str) -> PlanOp:
    """The op ``name`` names: a forward op or piece, or a piece's backward (``x.bw``, or
    ``x.w`` for the weight part of a split one), made on first mention as ``plan`` does."""
    try:
        return plan.op(name)
    except PlanError:
        pass
    base, _, part = name.rpartition(".")
    forward = plan._by_name.get(base)
    if part in ("bw", "w") and forward is not None and not forward.is_backward \
            and not forward.children:
        made = plan.backward_op(forward) if part == "bw" else plan.weight_op(forward)
        if made is not None and made.name == name:
            return made
    raise PlanError(f"{source} names op {name!r}, which this graph's plan does not have: "
                    "the model changed, or the file was made for another")
