"""Each rank's local names: fresh ones for lowering and the passes, and what each holds.

A name never reuses another op's graph name (``linear_10`` is always the op
``linear_10``'s output or a piece of it), nor a word the generated code uses, nor a
suffix codegen derives names with.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from fractions import Fraction

from chronotope.graph.ir import Graph, PTensor

# names the generated code uses
_RESERVED = frozenset({"rt", "torch", "operator", "step", "rng", "sliced_attention"})
_DERIVED = ("_in", "_share")  # suffixes codegen adds to a name


def identifier(hint: str) -> str:
    """``hint`` as a Python identifier."""
    return re.sub(r"\W", "_", hint).strip("_") or "t"


@dataclass
class Names:
    """Per rank: each local name's shape, the whole tensor it holds a piece of, the
    names every micro-batch of a template makes alike, and the share of a value a name
    holds that its reader applies (a bias read whole under a reduction split)."""

    ndevices: int
    graph: Graph
    shapes: list[dict[str, tuple[int, ...]]] = field(init=False)
    tensor_of: list[dict[str, PTensor]] = field(init=False)
    whole: list[set[str]] = field(init=False)
    share: list[dict[str, Fraction]] = field(init=False)

    def __post_init__(self) -> None:
        n = self.ndevices
        self.shapes, self.tensor_of = [{} for _ in range(n)], [{} for _ in range(n)]
        self.whole, self.share = [set() for _ in range(n)], [{} for _ in range(n)]
        self._taken = {identifier(name) for op in self.graph.ops
                       for name in (op.name, *(t.name for t in op.outputs))}

    def fresh(self, rank: int, hint: str, shape: tuple[int, ...]) -> str:
        """A fresh local name on ``rank`` for a tensor of ``shape``."""
        base = identifier(hint)
        if base[0].isdigit():
            base = "t_" + base
        if keyword.iskeyword(base) or base in _RESERVED or base.endswith(_DERIVED):
            base += "_"  # codegen derives ``x_in`` (a leaf) and ``x_share`` from names
        name, i = base, 1
        while name in self.shapes[rank] or name != base and name in self._taken:
            name, i = f"{base}_p{i}", i + 1  # another piece or part: never another op's name
        self.shapes[rank][name] = shape
        return name
