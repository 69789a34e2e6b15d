"""Outlining: stretches of a rank's generated code that repeat become one function.

A template's step runs once per micro-batch and a model's layers repeat; written
out, a GPT-3 rank is tens of thousands of lines. Codegen hands this module its
lines cut into stretches (each named for what it runs, or None: never outlined).
Stretches that are the same code up to their local names and some numbers or
strings become one function, and each is a call: what it reads from the caller
goes in, what the caller reads after it comes back, and the numbers or strings
that differ are arguments (an integer that follows the micro-batch index linearly
is written in terms of it). Nothing else changes: the calls run the same
statements in the same order.

A tensor that a stretch frees is freed by the caller right after the call (the
function's own ``del`` only drops its name), so it lives to the end of the call.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

LOCALS = "rt"  # the step's one parameter, the same in every function


@dataclass
class Stretch:
    """Consecutive lines of a body (statements with their indented continuations) and
    what a function made of them would be named for (None: never outlined)."""

    lines: list[str]
    name: str | None
    label: str | None = None  # what tells its repetitions apart in their strings (``h.3``)
    heading: bool = False  # its opening comments say which repetition it is: kept by the call


@dataclass
class _Statement:
    lines: list[str]
    tree: ast.Module
    skeleton: bytes  # its code with names and literal values blanked out
    names: list[tuple[int, int, str]]  # (line, byte offset, name) of each local name
    literals: list[tuple[int, int, int, Any]]  # (line, start, end, value) of each literal
    uses: set[str] = field(default_factory=set)  # read before it sets them
    defs: set[str] = field(default_factory=set)  # every name it sets
    made: set[str] = field(default_factory=set)  # set when it ends
    kills: set[str] = field(default_factory=set)  # deleted when it ends
    at: int = 0  # where it stands in the body
    nodes: list[ast.Name | ast.Constant] = field(default_factory=list)
    first: int = 0  # the line of the parsed text its first line is


def outline(stretches: list[Stretch], cheap: dict[str, str] | None = None, minimum: int = 4,
            reserved: frozenset[str] = frozenset()) -> tuple[list[list[str]], list[list[str]]]:
    """Each stretch's lines, repeated ones as calls, and the functions they call.
    A stretch is outlined where at least two stretches are alike and the function is
    at least ``minimum`` statements long, and named for its stretches (not a local name,
    not one of ``reserved``).

    ``cheap``: names set by an expression that is cheap to run again (a parameter
    region: a lookup), and that expression. Where one is set once, that statement
    leaves the stretches: a function sets what it reads itself instead of taking it
    from the caller, and ``with_cheap`` sets the rest before their first reader."""
    cut = [_statements(s.lines) for s in stretches]
    sets: dict[str, int] = defaultdict(int)
    for statements in cut:
        for st in statements:
            for n in st.defs:
                sets[n] += 1
    known = {n: e for n, e in (cheap or {}).items() if sets[n] <= 1}
    cut = [[st for st in statements if not _sets(st, known)] for statements in cut]
    local = {n for statements in cut for st in statements for n in st.defs} | set(known)
    flat = [st for statements in cut for st in statements]
    for at, st in enumerate(flat):
        st.at = at
        _analyse(st, local)
    live_after = _liveness(flat, set(known))
    groups: dict[tuple, list[int]] = defaultdict(list)
    shapes, bodies = {}, {}
    for k, (stretch, statements) in enumerate(zip(stretches, cut)):
        if stretch.name is None or len(_body(statements, stretch.heading)) < minimum:
            continue
        bodies[k] = body = _own_frees(_body(statements, stretch.heading), local)
        # (what it read and freed at its very end is the caller's to free after the call)
        shapes[k] = shape = _Shape.of(body, live_after[statements[-1].at])
        groups[(stretch.name, *shape.signature)].append(k)
    outlined = {key: members for key, members in groups.items() if len(members) > 1}
    # a stretch that is one of them and then more (what another step's code put at its
    # end: a receive posted early) is a call and the rest
    lengths: dict[int, int] = {}  # stretch -> how many of its statements the call runs
    assigned = {k for members in outlined.values() for k in members}
    for key, members in sorted(outlined.items(), key=lambda g: -len(g[0][1])):
        size = len(key[1])
        for k, body in bodies.items():
            if k in assigned or len(body) <= size or stretches[k].name != key[0]:
                continue
            shape = _Shape.of(body[:size], live_after[body[size - 1].at])
            if shape.signature == key[1:]:
                members.append(k)
                assigned.add(k)
                shapes[k], lengths[k] = shape, size
    calls: dict[int, list[str]] = {}
    functions: list[list[str]] = []
    taken: dict[str, int] = defaultdict(int)
    for (name, *_), members in outlined.items():
        base = re.sub(r"\W", "_", name)
        fname = base if not taken[base] else f"{base}_{taken[base] + 1}"
        taken[base] += 1
        fname = _fresh(fname, local | reserved)
        first = bodies[members[0]][:lengths.get(members[0])]
        outputs = tuple(sorted({i for k in members for i in shapes[k].outputs}))
        function, made = _function(fname, [shapes[k] for k in members],
                                   [stretches[k].label for k in members], first, known, outputs)
        functions.append(function)
        for k, call in zip(members, made):
            rest = [] if k not in lengths else \
                [st for st in cut[k] if st.at > bodies[k][lengths[k] - 1].at]
            heading = [line for st in _leading(cut[k]) for line in st.lines] \
                if stretches[k].heading else []
            if len(heading) == 1:  # the call, labelled
                call, heading = [f"{call[0]}  {heading[0].strip()}", *call[1:]], []
            calls[k] = heading + call + \
                [line for st in rest for line in st.lines]
    return [calls[k] if k in calls else [line for st in statements for line in st.lines]
            for k, statements in enumerate(cut)], functions


def with_cheap(lines: list[str], cheap: dict[str, str]) -> list[str]:
    """``lines`` with each cheap name they read set right before the statement that
    first reads it (a name found in a string or an attribute is set early: as good)."""
    if not cheap:
        return lines
    found = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, cheap)) + r")(?!\w)")
    out: list[str] = []
    unset, start = dict(cheap), 0
    for line in lines:
        if not line.startswith((" ", "\t")):
            start = len(out)  # where the statement this line is part of starts
        made = [f"{n} = {unset.pop(n)}" for n in dict.fromkeys(found.findall(line))
                if n in unset]
        out[start:start] = made
        out.append(line)
    return out


def _sets(st: _Statement, cheap: dict[str, str]) -> bool:
    """Whether ``st`` is ``name = <its cheap expression>``."""
    node = st.tree.body[0] if len(st.tree.body) == 1 else None
    return isinstance(node, ast.Assign) and len(node.targets) == 1 and \
        isinstance(node.targets[0], ast.Name) and len(st.lines) == 1 and \
        st.lines[0].strip() == f"{node.targets[0].id} = {cheap.get(node.targets[0].id)}"


def _statements(lines: list[str]) -> list[_Statement]:
    """``lines`` as statements: a line and the more-indented lines after it (parsed as
    one text: one parse, not one per statement)."""
    starts: list[int] = []
    for k, line in enumerate(lines):
        if not (starts and line.startswith((" ", "\t"))):
            starts.append(k)
    at = {node.lineno - 1: node for node in ast.parse("\n".join(lines)).body}
    return [_parse(lines[start:end], at.get(start), start)
            for start, end in zip(starts, [*starts[1:], len(lines)])]


def _parse(lines: list[str], node: ast.stmt | None, first: int) -> _Statement:
    """A statement (``node``, None for a comment) of ``lines``, which start at line
    ``first`` of the parsed text."""
    tree = ast.Module(body=[node] if node is not None else [], type_ignores=[])
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Constant))]
    names = [n for n in nodes if isinstance(n, ast.Name)]
    defs = {n.id for n in names if isinstance(n.ctx, ast.Store)}
    if node is not None and not isinstance(node, ast.With):  # (read, then set)
        gone = {n.id for n in names if isinstance(n.ctx, ast.Del)}
        uses = {n.id for n in names if not isinstance(n.ctx, ast.Store)}
        made, kills = defs - gone, gone
    else:
        uses, made, kills = _effect(tree.body)
    return _Statement(lines, tree, b"", [], [], uses=uses, defs=defs, made=made, kills=kills,
                      nodes=nodes, first=first)


def _effect(nodes: list[ast.stmt]) -> tuple[set[str], set[str], set[str]]:
    """What statements run in order read before they set it, what they leave set, and
    what they leave deleted."""
    uses: set[str] = set()
    made: set[str] = set()
    kills: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.With):
            read = {n.id for item in node.items for n in ast.walk(item)
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            inner, set_, gone = _effect(node.body)
            read |= inner
        else:
            names = [n for n in ast.walk(node) if isinstance(n, ast.Name)]
            read = {n.id for n in names if isinstance(n.ctx, (ast.Load, ast.Del))}
            set_ = {n.id for n in names if isinstance(n.ctx, ast.Store)}
            gone = {n.id for n in names if isinstance(n.ctx, ast.Del)}
        uses |= read - made
        made = (made | set_) - gone
        kills = (kills - set_) | gone
    return uses, made, kills


def _analyse(st: _Statement, local: set[str]) -> None:
    """Its local names and literals, in source order, and its skeleton: its code with
    each of them blanked out (and no comment)."""
    found = sorted(((n.lineno - 1 - st.first, n.col_offset, n) for n in st.nodes
                    if isinstance(n, ast.Name) and n.id in local or
                    isinstance(n, ast.Constant) and type(n.value) in (int, float, str)),
                   key=lambda f: (f[0], f[1]))
    text = [line.encode() for line in st.lines]
    if st.tree.body:
        last = st.tree.body[-1]
        assert last.end_lineno is not None and last.end_col_offset is not None
        text = text[:last.end_lineno - st.first]
        text[-1] = text[-1][:last.end_col_offset]
    else:
        text = [b"#"]
    for line, col, node in reversed(found):
        assert node.end_col_offset is not None
        if isinstance(node, ast.Name):
            st.names.append((line, col, node.id))
            blank = b"\0"
        else:
            st.literals.append((line, col, node.end_col_offset, node.value))
            blank = b"\1"
        text[line] = text[line][:col] + blank + text[line][node.end_col_offset:]
    st.names.reverse()
    st.literals.reverse()
    st.skeleton = b"\n".join(text)
    st.uses &= local


def _liveness(statements: list[_Statement], ignored: set[str]) -> list[set[str]]:
    """For each statement, the local names read after it before they are set again (of
    those not ``ignored``: names no statement sets, alive throughout)."""
    live: set[str] = set()
    after: list[set[str]] = [live] * len(statements)
    for k in range(len(statements) - 1, -1, -1):
        after[k] = live
        st = statements[k]
        live = (live - st.made - st.kills) | (st.uses - ignored)
    return after


def _leading(statements: list[_Statement]) -> list[_Statement]:
    """The comments a stretch opens with."""
    out = []
    for st in statements:
        if st.tree.body:
            break
        out.append(st)
    return out


def _body(statements: list[_Statement], heading: bool) -> list[_Statement]:
    return statements[len(_leading(statements)):] if heading else statements


def _own_frees(body: list[_Statement], local: set[str]) -> list[_Statement]:
    """``body`` freeing only what it makes: a name it takes from before is freed by the
    caller after the call (inside, a ``del`` would only drop the function's own name),
    so the last repetition, which frees what the others read, is written alike."""
    made: set[str] = set()
    out = []
    for st in body:
        node = st.tree.body[0] if len(st.tree.body) == 1 else None
        if isinstance(node, ast.Delete) and len(st.lines) == 1:
            names = [n for *_, n in st.names]  # (the tree's own names are blanked)
            kept = [n for n in names if n in made]
            if len(kept) < len(names):
                if kept:
                    indent = st.lines[0][:len(st.lines[0]) - len(st.lines[0].lstrip())]
                    fresh = _statements([f"{indent}del {', '.join(kept)}"])[0]
                    _analyse(fresh, local)
                    fresh.at = st.at
                    out.append(fresh)
                continue
        out.append(st)
        made |= st.defs
    return out

@dataclass(frozen=True)
class _Shape:
    """A stretch up to its names and literals: equal keys run the same code."""

    key: tuple
    inputs: tuple[int, ...]  # the names it reads from before it, by first appearance
    outputs: tuple[int, ...]  # the names it sets that are read after it
    names: tuple[str, ...] = field(compare=False)  # its names, by first appearance
    literals: tuple[Any, ...] = field(compare=False)
    dropped: tuple[str, ...] = field(compare=False)  # inputs nothing reads after it

    @property
    def signature(self) -> tuple:
        """What stretches that one function runs share (what each returns that nothing
        reads after it is freed right away)."""
        return self.key, self.inputs

    @staticmethod
    def of(body: list[_Statement], live_after: set[str]) -> _Shape:
        index: dict[str, int] = {}
        pattern, literals = [], []
        defined: set[str] = set()
        inputs: dict[int, None] = {}
        for st in body:
            pattern.append((st.skeleton, tuple(index.setdefault(n, len(index))
                                               for _, _, n in st.names),
                            tuple(type(v).__name__ for *_, v in st.literals)))
            literals += [v for *_, v in st.literals]
            read = sorted(st.uses - defined, key=lambda n: index[n])
            inputs.update((index[n], None) for n in read)
            defined = (defined | st.made) - st.kills
        outputs = tuple(index[n] for n in sorted(defined & live_after, key=lambda n: index[n]))
        names = tuple(index)
        dropped = tuple(names[i] for i in inputs if names[i] not in live_after)
        return _Shape(tuple(pattern), tuple(inputs), outputs, names, tuple(literals), dropped)


def _function(name: str, shapes: list[_Shape], labels: list[str | None],
              body: list[_Statement], cheap: dict[str, str], outputs: tuple[int, ...]
              ) -> tuple[list[str], list[list[str]]]:
    """The function the stretches of ``shapes`` become (written from the first), and
    each one's call; ``labels``: each stretch's label; ``outputs``: what it returns."""
    first = shapes[0]
    arguments = _Arguments(set(first.names) | {LOCALS}, labels)
    knobs = [k for k in range(len(first.literals))
             if len({repr(s.literals[k]) for s in shapes}) > 1]
    micro = _micro_knob(body, knobs)
    m = arguments.take(tuple(s.literals[micro] for s in shapes), "m") if micro is not None \
        else ""
    written = {}
    for k in knobs:
        values = tuple(s.literals[k] for s in shapes)
        linear = _linear(shapes, micro, k) if micro is not None and k != micro else None
        written[k] = linear.replace("{m}", m) if linear else arguments.labelled(values) or \
            arguments.take(values)
    # an input every call would pass alike (up to its label) and the function can set
    # as cheaply itself
    own = {}
    for i in first.inputs:
        if all(s.names[i] in cheap for s in shapes):
            made = arguments.labelled(tuple(cheap[s.names[i]] for s in shapes), code=True)
            if made is not None or len({cheap[s.names[i]] for s in shapes}) == 1:
                own[first.names[i]] = made or cheap[first.names[i]]
    passed = [i for i in first.inputs if first.names[i] not in own]
    params = [LOCALS, *arguments.names, *(first.names[i] for i in passed)]
    lines = [f"def {name}({', '.join(params)}):"]
    unset = set(own)
    k = 0
    for st in body:
        if st.uses & unset:  # set right before its first reader, as the caller did
            lines += [f"    {n} = {own[n]}" for n in sorted(st.uses & unset,
                                                             key=first.names.index)]
            unset -= st.uses
        edits = []
        for line, start, end, _ in st.literals:
            if k in written:
                edits.append((line, start, end, written[k]))
            k += 1
        lines += ["    " + text for text in _edited(st.lines, edits)]
    if outputs:
        lines.append(f"    return {', '.join(first.names[i] for i in outputs)}")
    calls = []
    for c, shape in enumerate(shapes):
        args = [LOCALS, *(repr(values[c]) for values in arguments.values),
                *(shape.names[i] for i in passed)]
        call = f"{name}({', '.join(args)})"
        outs = [shape.names[i] for i in outputs]
        gone = [*(n for n in shape.dropped if n not in outs and n not in cheap),
                *(shape.names[i] for i in outputs if i not in shape.outputs)]
        calls.append([f"{', '.join(outs)} = {call}" if outs else call,
                      *([f"del {', '.join(gone)}"] if gone else [])])
    return lines, calls


class _Arguments:
    """A function's arguments besides ``rt`` and the names it reads: the values that
    differ between its calls, one argument per distinct row of values."""

    def __init__(self, taken: set[str], labels: list[str | None]) -> None:
        self.taken, self.labels = taken, tuple(labels)
        self.named: list[tuple[str, tuple]] = []  # the micro-batch index and the label
        self.plain: list[tuple[str, tuple]] = []

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.named + self.plain]

    @property
    def values(self) -> list[tuple]:
        return [values for _, values in self.named + self.plain]

    def take(self, values: tuple, hint: str = "") -> str:
        """The argument that is ``values`` in each call (``hint``: its name, first)."""
        for name, known in self.named + self.plain:
            if known == values:
                return name
        name = _fresh(hint or f"a{len(self.plain)}", self.taken)
        self.taken.add(name)
        (self.named if hint else self.plain).append((name, values))
        return name

    def labelled(self, values: tuple, code: bool = False) -> str | None:
        """Strings (with ``code``, lines of code whose string literal holds it) that are
        each call's label within the same text: an f-string of the label's argument."""
        labels = tuple(label for label in self.labels if label is not None)
        if len(labels) < len(values) or not all(isinstance(v, str) and label in v
                                                for v, label in zip(values, labels)):
            return None
        if len({v.replace(label, "\0", 1) for v, label in zip(values, labels)}) > 1:
            return None
        if not code:
            escaped = values[0].replace("{", "{{").replace("}", "}}")
            return "f" + repr(escaped.replace(labels[0], self._at(labels), 1))
        text, label = values[0], labels[0]  # a label inside the code's string literal
        start = text.find(label)
        opening = max(text.rfind("'", 0, start), text.rfind('"', 0, start))
        if opening < 0 or text[:opening].count(text[opening]) % 2 or "{" in text or "}" in text:
            return None
        return text[:opening] + "f" + text[opening:start] + self._at(labels) + \
            text[start + len(label):]

    def _at(self, labels: tuple[str, ...]) -> str:
        return "{" + self.take(labels, "at") + "}"


def _micro_knob(body: list[_Statement], knobs: list[int]) -> int | None:
    """The literal that is the micro-batch index (``rt.micro(<index>)``), if it differs."""
    k = 0
    for st in body:
        for _ in st.literals:
            if k in knobs and len(st.lines) == 1 and st.lines[0].startswith(f"{LOCALS}.micro("):
                return k
            k += 1
    return None


def _linear(shapes: list[_Shape], micro: int, k: int) -> str | None:
    """Literal ``k`` as ``a * {m} + b`` of the micro-batch index, where every stretch
    agrees (integers only)."""
    pairs = [(s.literals[micro], s.literals[k]) for s in shapes]
    if any(type(x) is not int or type(y) is not int for x, y in pairs):
        return None
    (x0, y0), (x1, y1) = pairs[0], next(((x, y) for x, y in pairs if x != pairs[0][0]),
                                        (None, None))
    if x1 is None or (y1 - y0) % (x1 - x0):
        return None
    a = (y1 - y0) // (x1 - x0)
    b = y0 - a * x0
    if any(y != a * x + b for x, y in pairs):
        return None
    term = "{m}" if a == 1 else f"{a} * {{m}}"
    return term if b == 0 else f"{term} + {b}" if b > 0 else f"{term} - {-b}"


def _fresh(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_"
    return name


def _edited(lines: list[str], edits: list[tuple[int, int, int, str]]) -> list[str]:
    """``lines`` with the byte ranges of ``edits`` (line, start, end, text) replaced."""
    out = [line.encode() for line in lines]
    for line, start, end, text in sorted(edits, reverse=True):
        out[line] = out[line][:start] + text.encode() + out[line][end:]
    return [line.decode() for line in out]
