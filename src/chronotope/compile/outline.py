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


@dataclass
class _Statement:
    lines: list[str]
    tree: ast.Module
    skeleton: str  # its code with names and literal values blanked out
    names: list[tuple[int, int, str]]  # (line, byte offset, name) of each local name
    literals: list[tuple[int, int, int, Any]]  # (line, start, end, value) of each literal
    uses: set[str] = field(default_factory=set)
    defs: set[str] = field(default_factory=set)
    at: int = 0  # where it stands in the body


def outline(stretches: list[Stretch], cheap: dict[str, str] | None = None, minimum: int = 4
            ) -> tuple[list[str], list[list[str]]]:
    """The body's lines with repeated stretches as calls, and the functions they call.
    A stretch is outlined where at least two stretches are alike and the function is
    at least ``minimum`` statements long. ``cheap``: names set once, by an expression
    that is cheap to run again (a parameter region: a lookup), and what sets them; a
    function sets those it reads itself instead of taking them from the caller."""
    cut = [_statements(s.lines) for s in stretches]
    local = {n for statements in cut for st in statements for n in st.defs}
    flat = [st for statements in cut for st in statements]
    for at, st in enumerate(flat):
        st.at = at
        _analyse(st, local)
    live_after = _liveness(flat)
    groups: dict[tuple, list[int]] = defaultdict(list)
    shapes, bodies = {}, {}
    for k, (stretch, statements) in enumerate(zip(stretches, cut)):
        if stretch.name is None or len(_body(statements)) < minimum:
            continue
        bodies[k] = body = _own_frees(_body(statements), local)
        shapes[k] = shape = _Shape.of(body, live_after[body[-1].at])
        groups[(stretch.name, *shape.signature)].append(k)
    outlined = {key: members for key, members in groups.items() if len(members) > 1}
    # a stretch that is one of them and then more (what another step's code put at its
    # end: a receive posted early) is a call and the rest
    lengths: dict[int, int] = {}  # stretch -> how many of its statements the call runs
    assigned = {k for members in outlined.values() for k in members}
    for key, members in sorted(outlined.items(), key=lambda g: -len(g[0][1])):
        n = len(key[1])
        for k, body in bodies.items():
            if k in assigned or len(body) <= n or stretches[k].name != key[0]:
                continue
            shape = _Shape.of(body[:n], live_after[body[n - 1].at])
            if shape.signature == key[1:]:
                members.append(k)
                assigned.add(k)
                shapes[k], lengths[k] = shape, n
    calls: dict[int, list[str]] = {}
    functions: list[list[str]] = []
    taken: dict[str, int] = defaultdict(int)
    known = _cheap(cheap or {}, local, cut)
    for (name, *_), members in outlined.items():
        base = re.sub(r"\W", "_", name)
        fname = base if not taken[base] else f"{base}_{taken[base] + 1}"
        taken[base] += 1
        first = bodies[members[0]][:lengths.get(members[0])]
        outputs = tuple(sorted({i for k in members for i in shapes[k].outputs}))
        function, made = _function(fname, [shapes[k] for k in members], first, known, outputs)
        functions.append(function)
        for k, call in zip(members, made):
            rest = [] if k not in lengths else \
                [st for st in cut[k] if st.at > bodies[k][lengths[k] - 1].at]
            calls[k] = [line for st in [*_leading(cut[k])] for line in st.lines] + call + \
                [line for st in rest for line in st.lines]
    lines = [line for k, statements in enumerate(cut)
             for line in (calls[k] if k in calls else
                          (line for st in statements for line in st.lines))]
    return (_without_unread(lines, set(known)) if functions else lines), functions


def _without_unread(lines: list[str], cheap: set[str]) -> list[str]:
    """``lines`` without what sets a cheap name nothing reads any more (the functions
    set their own), and without freeing it."""
    statements = _statements(lines)
    read = {n.id for st in statements for node in st.tree.body if not isinstance(node, ast.Delete)
            for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    unread = cheap - read
    out = []
    for st in statements:
        node = st.tree.body[0] if len(st.tree.body) == 1 else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name) and node.targets[0].id in unread:
            continue
        if isinstance(node, ast.Delete) and len(st.lines) == 1:
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            kept = [n for n in names if n not in unread]
            if len(kept) < len(names):
                indent = st.lines[0][:len(st.lines[0]) - len(st.lines[0].lstrip())]
                out += [f"{indent}del {', '.join(kept)}"] if kept else []
                continue
        out += st.lines
    return out


def _statements(lines: list[str]) -> list[_Statement]:
    """``lines`` as statements: a line and the more-indented lines after it."""
    grouped: list[list[str]] = []
    for line in lines:
        if grouped and line.startswith((" ", "\t")):
            grouped[-1].append(line)
        else:
            grouped.append([line])
    return [_parse(g) for g in grouped]


def _parse(lines: list[str]) -> _Statement:
    tree = ast.parse("\n".join(lines))
    defs = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Store)}
    return _Statement(lines, tree, "", [], [], defs=defs)


def _analyse(st: _Statement, local: set[str]) -> None:
    """Its local names and literals, in source order, and its skeleton."""
    found: list[tuple[int, int, ast.Name | ast.Constant]] = []
    for node in ast.walk(st.tree):
        if isinstance(node, ast.Name) and node.id in local:
            found.append((node.lineno - 1, node.col_offset, node))
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
            found.append((node.lineno - 1, node.col_offset, node))
    found.sort(key=lambda f: (f[0], f[1]))
    for line, col, node in found:
        if isinstance(node, ast.Name):
            st.names.append((line, col, node.id))
            if isinstance(node.ctx, (ast.Load, ast.Del)):
                st.uses.add(node.id)
            node.id = "_"
        else:
            assert node.end_col_offset is not None
            st.literals.append((line, col, node.end_col_offset, node.value))
            node.value = "\0"
    st.skeleton = ast.dump(st.tree)


def _liveness(statements: list[_Statement]) -> list[set[str]]:
    """For each statement, the local names read after it before they are set again."""
    live: set[str] = set()
    after: list[set[str]] = [set() for _ in statements]
    for k in range(len(statements) - 1, -1, -1):
        after[k] = live
        st = statements[k]
        live = (live - st.defs) | st.uses
    return after


def _leading(statements: list[_Statement]) -> list[_Statement]:
    """The comments a stretch opens with: they stay where the call is (they say which
    repetition it is)."""
    out = []
    for st in statements:
        if st.tree.body:
            break
        out.append(st)
    return out


def _body(statements: list[_Statement]) -> list[_Statement]:
    return statements[len(_leading(statements)):]


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
                    fresh = _parse([f"{indent}del {', '.join(kept)}"])
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
            defined |= st.defs
        outputs = tuple(index[n] for n in sorted(defined & live_after, key=lambda n: index[n]))
        names = tuple(index)
        dropped = tuple(names[i] for i in inputs if names[i] not in live_after)
        return _Shape(tuple(pattern), tuple(inputs), outputs, names, tuple(literals), dropped)


def _cheap(cheap: dict[str, str], local: set[str], cut: list[list[_Statement]]
           ) -> dict[str, str]:
    """Of ``cheap``, the names set once in the body, with the expression that sets them."""
    sets: dict[str, int] = defaultdict(int)
    for statements in cut:
        for st in statements:
            for n in st.defs:
                sets[n] += 1
    return {n: line.split(" = ", 1)[1] for n, line in cheap.items()
            if sets[n] == 1 and n in local}


def _function(name: str, shapes: list[_Shape], body: list[_Statement], cheap: dict[str, str],
              outputs: tuple[int, ...]) -> tuple[list[str], list[list[str]]]:
    """The function the stretches of ``shapes`` become (written from the first), and
    each one's call; ``outputs``: what it returns."""
    first = shapes[0]
    # an input every call would pass alike and the function can set as cheaply itself
    own = [i for i in first.inputs if all(s.names[i] in cheap for s in shapes) and
           len({cheap[s.names[i]] for s in shapes}) == 1]
    passed = [i for i in first.inputs if i not in own]
    knobs = [k for k in range(len(first.literals))
             if len({repr(s.literals[k]) for s in shapes}) > 1]
    taken = set(first.names) | {LOCALS}
    micro = _micro_knob(body, knobs)
    arguments: list[tuple[int, str]] = []
    written: dict[int, str] = {}
    for k in knobs:
        if micro is not None and k != micro and (linear := _linear(shapes, micro, k)):
            written[k] = linear
            continue
        arg = _fresh("m" if k == micro else f"a{len(arguments)}", taken)
        taken.add(arg)
        arguments.append((k, arg))
        written[k] = arg
    if micro is not None:
        arg = dict(arguments)[micro]
        written.update((k, text.replace("{m}", arg)) for k, text in written.items())
    params = [LOCALS, *(a for _, a in arguments), *(first.names[i] for i in passed)]
    lines = [f"def {name}({', '.join(params)}):"]
    unset = {first.names[i] for i in own}
    k = 0
    for st in body:
        if st.uses & unset:  # set right before its first reader, as the caller did
            lines += [f"    {n} = {cheap[n]}" for n in sorted(st.uses & unset,
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
    for shape in shapes:
        args = [LOCALS, *(repr(shape.literals[k]) for k, _ in arguments),
                *(shape.names[i] for i in passed)]
        call = f"{name}({', '.join(args)})"
        outs = [shape.names[i] for i in outputs]
        gone = [*(n for n in shape.dropped if n not in outs),  # (a name set again is let go)
                *(shape.names[i] for i in outputs if i not in shape.outputs)]
        calls.append([f"{', '.join(outs)} = {call}" if outs else call,
                      *([f"del {', '.join(gone)}"] if gone else [])])
    return lines, calls


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
