"""What an expert knows about the plan, as constraints the search keeps to.

A constraint either narrows the knobs of a point (``tp = 4``, ``pp in 2, 4``, ``micro
in 4..16``, ``coshard = 2``, ``schedule = zb1``, ``recompute = full``, ``swap``,
``sequence``, ``zero``)
or the cuts of ops (``Cut("h.*.attn.*", "split n*")``: ops by name or module pattern,
or ``kind:attention`` by op kind, keep the strategies whose label matches). A family of
the search honours the constraints whose knobs it has: the mesh policy's knobs all
but cuts; the per-op ILP and its stage DP cuts, stages, micro-batches and its pipelines'
1F1B (recompute and swap off); D-Rec none. Written in Python (``Constraints.parse``
of a mapping) or in TOML (``Constraints.load``)::

    tp = 4
    pp = [2, 4]
    micro = {min = 4, max = 16}
    schedule = "1f1b"
    [cuts]
    "kind:embedding" = "replicate"

When nothing satisfies them, ``smallest`` (a deletion filter) finds the fewest that
still conflict, so that the error names them and what falls short.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chronotope.errors import ChronotopeError
from chronotope.plan.check import format_bytes

DEGREES = ("dp", "tp", "pp", "micro", "chunks", "cp", "ep", "coshard")
CHOICES: dict[str, tuple[Any, ...]] = {
    "schedule": ("none", "1f1b", "zb1", "interleaved", "3f1b"),  # "none": no pipeline
    "recompute": ("none", "selective", "full"),
    "swap": (False, True),
    "sequence": (False, True),
    "zero": ("none", "zero1", "zero3"),  # the optimizer state, or the weights too, sharded
}
# the knobs each family has: a constraint on another knob excludes the family
FAMILY_KNOBS = {"mesh": frozenset(DEGREES) | frozenset(CHOICES),
                "ilp": frozenset({"pp", "micro", "schedule", "recompute", "swap", "cuts"}),
                "drec": frozenset()}


class ConstraintError(ChronotopeError):
    """A search constraint that does not parse, names no op, or leaves one no way to run."""


@dataclass(frozen=True)
class Knob:
    """A knob kept to ``values``, or to ``low..high`` (either may be open)."""

    knob: str
    values: tuple[Any, ...] = ()
    low: int | None = None
    high: int | None = None

    def admits(self, value: Any) -> bool:
        if self.values:
            return value in self.values
        return (self.low is None or value >= self.low) and \
            (self.high is None or value <= self.high)

    @property
    def name(self) -> str:
        if len(self.values) == 1:
            return f"{self.knob} = {_text(self.values[0])}"
        if self.values:
            return f"{self.knob} in {', '.join(map(_text, self.values))}"
        if self.high is None:
            return f"{self.knob} >= {self.low}"
        if self.low is None:
            return f"{self.knob} <= {self.high}"
        return f"{self.knob} in {self.low}..{self.high}"


@dataclass(frozen=True)
class Cut:
    """Ops whose name or module matches ``ops`` (``kind:<kind>``: whose op kind does)
    keep the strategies whose label matches ``allowed`` (``space.constrain``)."""

    ops: str
    allowed: str
    knob = "cuts"

    @property
    def name(self) -> str:
        return f"{self.ops} = {self.allowed}"


@dataclass(frozen=True)
class Memory:
    """The memory per device, as a conflict names it beside the constraints."""

    limit: float
    knob = "memory"

    @property
    def name(self) -> str:
        return f"memory <= {format_bytes(self.limit)} per device"


Constraint = Knob | Cut | Memory


class Constraints(tuple[Constraint, ...]):
    """The constraints of one search, in the order given."""

    @classmethod
    def parse(cls, spec: Constraints | Mapping[str, Any] | str | Path | None,
              where: str = "the constraints") -> Constraints:
        """``spec`` as constraints: these already, a TOML file's path, or a mapping of
        knobs (``{"tp": 4, "pp": [2, 4], "micro": {"min": 4}}``) and cuts (under
        ``"cuts"``, or any other key whose value is a strategy label: ``{"lm_head":
        "replicate"}``)."""
        if spec is None:
            return cls()
        if isinstance(spec, Constraints):
            return spec
        if isinstance(spec, (str, Path)):
            return cls.load(spec)
        out: list[Constraint] = []
        for key, value in spec.items():
            if key == "cuts":
                if not isinstance(value, Mapping):
                    raise ConstraintError(f"{where}: cuts must be a table of OPS = CUT")
                out += [_cut(ops, allowed, where) for ops, allowed in value.items()]
            elif key in DEGREES or key in CHOICES:
                out.append(_knob(key, value, where))
            elif isinstance(value, str):
                out.append(_cut(key, value, where))
            else:
                raise ConstraintError(
                    f"{where}: unknown constraint {key!r} = {value!r}: the knobs are "
                    f"{', '.join((*DEGREES, *CHOICES))}; an op pattern takes a strategy "
                    "label (\"replicate\", \"split b*\")")
        return cls(out)

    @classmethod
    def load(cls, path: str | Path) -> Constraints:
        """The constraints of a TOML file."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConstraintError(f"cannot read the constraints file {path}: "
                                  f"{e.strerror}") from None
        try:
            table = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConstraintError(f"{path} is not TOML: {e}") from None
        return cls.parse(table, str(path))

    @property
    def cuts(self) -> dict[str, str]:
        return {c.ops: c.allowed for c in self if isinstance(c, Cut)}

    def admits(self, values: Mapping[str, Any]) -> bool:
        """Whether a point with these knob ``values`` keeps to every knob constraint;
        a knob it has no value of it keeps to only if the constraint admits its default."""
        return all(c.admits(values.get(c.knob, _DEFAULTS[c.knob]))
                   for c in self if isinstance(c, Knob))

    def violated(self, values: Mapping[str, Any]) -> list[str]:
        return [c.name for c in self if isinstance(c, Knob) and
                not c.admits(values.get(c.knob, _DEFAULTS[c.knob]))]

    def unhonoured(self, family: str) -> list[str]:
        """The constraints ``family`` cannot keep to: on knobs it does not have, or, of
        the ILP's, ruling out all it can do (its pipelines run 1F1B, recompute nothing)."""
        has = FAMILY_KNOBS[family]
        return [c.name for c in self if isinstance(c, (Knob, Cut)) and (
            c.knob not in has or family == "ilp" and isinstance(c, Knob) and c.knob in _FIXED and
            not any(c.admits(v) for v in _FIXED[c.knob]))]

    def without(self, gone: Constraint) -> Constraints:
        return Constraints(c for c in self if c is not gone)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self]


_DEFAULTS: dict[str, Any] = {"dp": 1, "tp": 1, "pp": 1, "micro": 1, "chunks": 1, "cp": 1,
                             "ep": 1, "coshard": 1, "schedule": "none", "recompute": "none",
                             "swap": False, "sequence": False, "zero": "none"}
_FIXED = {"schedule": ("none", "1f1b"), "recompute": ("none",), "swap": (False,)}


def knob_values(k: Any) -> dict[str, Any]:
    """A mesh point's (``knobs.Knobs``) value of every knob."""
    return {"dp": k.dp, "tp": k.tp, "pp": k.pp, "micro": k.micro, "chunks": k.chunks,
            "cp": k.cp, "ep": k.ep, "coshard": k.coshard,
            "schedule": k.schedule if k.pp > 1 else "none",
            "recompute": k.recompute or "none", "swap": k.swap, "sequence": k.sequence,
            "zero": "zero3" if k.zero3 else "zero1" if k.shard else "none"}


def pipeline_values(stages: int, micro: int) -> dict[str, Any]:
    """An ILP option's knobs: one mesh (a stage, one micro-batch), or the stage DP's
    1F1B pipeline."""
    return {"pp": stages, "micro": micro, "schedule": "1f1b" if stages > 1 else "none"}


def smallest(constraints: Sequence[Constraint],
             feasible: Callable[[Sequence[Constraint]], bool]) -> list[Constraint]:
    """The fewest of ``constraints`` (infeasible together) that still are, by deletion:
    each is dropped if the rest still conflict, so every one kept is needed for the
    conflict (an irreducible subset, found in one pass)."""
    kept = list(constraints)
    for c in list(constraints):
        rest = [x for x in kept if x is not c]
        if not feasible(rest):
            kept = rest
    return kept


def joined(constraints: Iterable[Constraint]) -> str:
    return "; ".join(c.name for c in constraints)


def _knob(key: str, value: Any, where: str) -> Knob:
    if key in CHOICES:
        values = tuple(value) if isinstance(value, list) else (value,)
        bad = [v for v in values if v not in CHOICES[key] or type(v) is not
               type(CHOICES[key][0])]
        if bad or not values:
            raise ConstraintError(f"{where}: {key} = {value!r}: use one of "
                                  f"{', '.join(map(_text, CHOICES[key]))}, or a list of them")
        return Knob(key, values)
    if isinstance(value, Mapping):
        unknown = set(value) - {"min", "max"}
        low, high = value.get("min"), value.get("max")
        if unknown or not all(v is None or _positive(v) for v in (low, high)) or \
                low is not None and high is not None and low > high:
            raise ConstraintError(f"{where}: {key} = {dict(value)!r}: bounds are "
                                  "{min = A, max = B}, positive whole numbers, A <= B")
        return Knob(key, low=low, high=high)
    values = tuple(value) if isinstance(value, list) else (value,)
    if not values or not all(_positive(v) for v in values):
        raise ConstraintError(f"{where}: {key} = {value!r}: a degree is a positive whole "
                              "number, a list of them, or {min = A, max = B}")
    return Knob(key, values)


def _cut(ops: Any, allowed: Any, where: str) -> Cut:
    if not isinstance(ops, str) or not isinstance(allowed, str) or not ops or not allowed:
        raise ConstraintError(f"{where}: the cut {ops!r} = {allowed!r} is not OPS = CUT, "
                              "e.g. \"h.*.mlp.*\" = \"split b*\"")
    return Cut(ops, allowed)


def _positive(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _text(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


__all__ = ["CHOICES", "DEGREES", "ConstraintError", "Constraints", "Cut", "Knob", "Memory",
           "knob_values", "pipeline_values", "smallest"]
