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

Within a body, a run of statements that repeat up to the names one pass hands the
next and integers that move by one step (a function's calls, layer after layer or
step after step) becomes a ``for`` loop (``roll``): each function's body as it is
written, and the step's body by codegen.
"""

from __future__ import annotations

import ast
import functools
import keyword
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

LOCALS = "rt"  # the step's one parameter, the same in every function


@dataclass
class Stretch:
    """Consecutive lines of a body (statements with their indented continuations) and
    what a function made of them would be named for (None: never outlined)."""

    lines: list[str]
    name: str | None
    label: str | None = None  # what tells its repetitions apart in their strings (``h.3``)
    heading: bool = False  # its opening comments say which repetition it is: kept by the call


class _Found(NamedTuple):
    """A name or a literal of a statement: where it stands (line, start and end byte),
    and the name (``literal`` False) or the literal's value."""

    line: int
    start: int
    end: int
    value: Any
    literal: bool


@dataclass(slots=True)
class _Statement:
    lines: list[str]
    kind: str  # "comment", "del", "assign" (to one name: ``target``) or "code"
    found: tuple[_Found, ...]  # its names and literals, in source order
    end: tuple[int, int]  # (line, byte) where its code ends (a comment after it: not code)
    target: str | None = None
    uses: frozenset[str] = frozenset()  # read before it sets them
    defs: frozenset[str] = frozenset()  # every name it sets
    made: frozenset[str] = frozenset()  # set when it ends
    kills: frozenset[str] = frozenset()  # deleted when it ends
    skeleton: bytes = b""  # its code with local names and literal values blanked out
    names: tuple[tuple[int, int, str], ...] = ()  # (line, byte, name) of its local names
    literals: tuple[tuple[int, int, int, Any], ...] = ()  # (line, start, end, value)
    at: int = 0  # where it stands in the body


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


_NAME = re.compile(r"(?<![\w.])[A-Za-z_]\w*")


def with_cheap(lines: list[str], cheap: dict[str, str]) -> list[str]:
    """``lines`` with each cheap name they read set right before the statement that
    first reads it (a name found in a string or an attribute is set early: as good)."""
    if not cheap:
        return lines
    out: list[str] = []
    unset, start = dict(cheap), 0
    for line in lines:
        if not line.startswith((" ", "\t")):
            start = len(out)  # where the statement this line is part of starts
        made = [f"{n} = {unset.pop(n)}" for n in dict.fromkeys(_NAME.findall(line))
                if n in unset]
        out[start:start] = made
        out.append(line)
    return out


def _sets(st: _Statement, cheap: dict[str, str]) -> bool:
    """Whether ``st`` is ``name = <its cheap expression>``."""
    return st.kind == "assign" and len(st.lines) == 1 and st.target in cheap and \
        st.lines[0].strip() == f"{st.target} = {cheap[st.target]}"


def _statements(lines: list[str]) -> list[_Statement]:
    """``lines`` as statements: a line and the more-indented lines after it."""
    starts: list[int] = []
    for k, line in enumerate(lines):
        if not (starts and line.startswith((" ", "\t"))):
            starts.append(k)
    out = []
    for start, end in zip(starts, [*starts[1:], len(lines)]):
        scanned = _scanned(lines[start]) if end == start + 1 else None
        if scanned is None:
            out.append(_parsed(lines[start:end]))
        else:
            kind, found, stop, target, uses, defs, kills = scanned
            out.append(_Statement([lines[start]], kind, found, (0, stop), target, uses, defs,
                                  defs, kills))
    return out


# The statements codegen writes, read from their names, numbers, strings and what lies
# between (the ast module costs ten times more); any other statement is parsed.
_PARTS = re.compile(r"""(
    \#.*
  | [A-Za-z_]\w*(?!['"])
  | (?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)(?:[eE][-+]?\d+)?(?![\w.])
  | '(?:\\.|[^'\\\n])*' | "(?:\\.|[^"\\\n])*"
)""", re.X)
_BETWEEN = re.compile(r"[ ()\[\]{},:.=+\-*/%<>!&|^~@]*")  # operators and spaces
_KEYWORDS = frozenset({"and", "or", "not", "in", "is", "if", "else", "None", "True", "False"})
_OTHER = frozenset(keyword.kwlist) - _KEYWORDS  # what the reading by parts leaves


@functools.lru_cache(maxsize=1 << 16)
def _scanned(line: str) -> tuple | None:
    """A one-line call, ``names = ...``, ``del names``, ``return ...`` or comment as
    (kind, found, where its code ends, target, read, set, deleted); None for any other
    statement. (Repetitions of a line are read once.)"""
    parts = _PARTS.split(line)
    between = "".join(parts[0::2])
    if not line.isascii() or not _BETWEEN.fullmatch(between) or ":=" in between:
        return None  # (an f-string, a bytes literal, ...)
    tokens = parts[1::2]
    if tokens and tokens[-1][0] == "#":
        tokens.pop()
    if not tokens:
        return "comment", (), 0, None, frozenset(), frozenset(), frozenset()
    if tokens[0] in ("if", "else") or _OTHER.intersection(tokens) - {"del", "return"}:
        return None  # (a compound statement, a lambda, a comprehension, ...)
    found: list[_Found] = []
    depth = at = 0
    cut = 0  # the tokens (and names found) before it are what an ``=`` sets
    targets = 0
    for k, token in enumerate(tokens):
        before = parts[2 * k]
        depth, assigns = _between(before, depth)
        if assigns:
            if cut or assigns > 1:
                return None  # (a chain of ``=``, a compound statement, an annotation)
            cut, targets = k, len(found)
        start = at + len(before)
        at = start + len(token)
        if token[0] in "'\"":
            if k and not before.strip() and tokens[k - 1][0] in "'\"":
                return None  # (one constant of two texts)
            found.append(_Found(0, start, at, ast.literal_eval(token) if "\\" in token
                                else token[1:-1], True))
        elif token[0].isdigit() or token[0] == ".":
            found.append(_Found(0, start, at, float(token) if set(token) & set(".eE")
                                else int(token), True))
        elif not (token in _KEYWORDS or k == 0 and token in ("del", "return") or
                  before.endswith(".") or depth and _keyword_argument(parts[2 * k + 2])):
            found.append(_Found(0, start, at, token, False))
    after = parts[2 * len(tokens)]
    if _between(after, depth)[1]:
        return None
    at += len(after.rstrip())
    if tokens[0] == "del":
        if len(found) < len(tokens) - 1 or any(f.literal for f in found) or \
                between.strip(" ,()"):
            return None  # (a subscript or an attribute deleted)
        names = frozenset(f.value for f in found)
        return "del", tuple(found), at, None, names, frozenset(), names
    if cut and (targets != cut or any(f.literal for f in found[:cut]) or
                ("".join(parts[0:2 * cut:2]) + parts[2 * cut].split("=")[0]).strip(" ,()")):
        return None  # (a subscript, an attribute or a literal set)
    sets = frozenset(f.value for f in found[:cut])
    reads = frozenset(f.value for f in found[cut:] if not f.literal)
    one = cut == 1 and "," not in parts[2]  # (``name, = ...`` sets a tuple)
    return "assign" if one else "code", tuple(found), at, found[0].value if one else None, \
        reads, sets, frozenset()


@functools.lru_cache(maxsize=4096)
def _between(text: str, depth: int) -> tuple[int, int]:
    """The bracket depth after ``text`` (operators between tokens), from ``depth``,
    and how many ``=`` or ``:`` it has outside brackets (an assignment, a compound
    statement)."""
    top = 0
    for k, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and (ch == ":" or ch == "=" and (k == 0 or text[k - 1] not in "=<>!")
                             and text[k + 1:k + 2] != "="):
            top += 1
    return depth, top


def _keyword_argument(after: str) -> bool:
    """Whether a name followed by ``after`` inside brackets is a keyword argument."""
    after = after.lstrip()
    return after.startswith("=") and not after.startswith("==")


def _parsed(lines: list[str]) -> _Statement:
    """A statement (with its indented lines) read by the ast module."""
    tree = ast.parse("\n".join(lines))
    if not tree.body:
        return _Statement(lines, "comment", (), (0, 0))
    node, = tree.body
    nodes = [n for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Constant))]
    found = tuple(sorted((_Found(n.lineno - 1, n.col_offset, n.end_col_offset or 0,
                           n.id if isinstance(n, ast.Name) else n.value,
                           isinstance(n, ast.Constant)) for n in nodes
                    if isinstance(n, ast.Name) or type(n.value) in (int, float, str)),
                   key=lambda f: (f.line, f.start)))
    assert node.end_lineno is not None and node.end_col_offset is not None
    end = (node.end_lineno - 1, node.end_col_offset)
    names = [n for n in nodes if isinstance(n, ast.Name)]
    defs = {n.id for n in names if isinstance(n.ctx, ast.Store)}
    one = isinstance(node, ast.Assign) and len(node.targets) == 1 and \
        isinstance(node.targets[0], ast.Name)
    kind = "del" if isinstance(node, ast.Delete) else "assign" if one else "code"
    target = node.targets[0].id if one else None  # type: ignore[attr-defined]
    if not isinstance(node, ast.With):  # (read, then set)
        gone = {n.id for n in names if isinstance(n.ctx, ast.Del)}
        uses = {n.id for n in names if not isinstance(n.ctx, ast.Store)}
        made, kills = defs - gone, gone
    else:
        uses, made, kills = _effect([node])
    return _Statement(lines, kind, found, end, target, frozenset(uses), frozenset(defs),
                      frozenset(made), frozenset(kills))


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
    if st.kind == "comment":
        st.skeleton = b"#"
        return
    kept = [f for f in st.found if f.literal or f.value in local]
    st.names = tuple((f.line, f.start, f.value) for f in kept if not f.literal)
    st.literals = tuple((f.line, f.start, f.end, f.value) for f in kept if f.literal)
    st.uses &= local
    if len(st.lines) == 1 and st.lines[0].isascii():  # (most: cut as text, in one go)
        line = st.lines[0]
        text, at = [], 0
        for f in kept:
            text += [line[at:f.start], "\1" if f.literal else "\0"]
            at = f.end
        text.append(line[at:st.end[1]])
        st.skeleton = "".join(text).encode()
        return
    lines = [line.encode() for line in st.lines[:st.end[0] + 1]]
    lines[-1] = lines[-1][:st.end[1]]
    for f in reversed(kept):
        lines[f.line] = lines[f.line][:f.start] + (b"\1" if f.literal else b"\0") + \
            lines[f.line][f.end:]
    st.skeleton = b"\n".join(lines)


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
        if st.kind != "comment":
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
        if st.kind == "del" and len(st.lines) == 1:
            names = [n for *_, n in st.names]
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
    lines[1:] = ["    " + line for line in roll([line[4:] for line in lines[1:]],
                                                 frozenset(params))]
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
    return _affine(a, b, "{m}")


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


# ---- runs of repetitions as loops --------------------------------------------------------

_LABEL = re.compile(r"#\s*step (\S+)")
_DIGITS = re.compile(r"(\d+)")


def roll(lines: list[str], given: frozenset[str] = frozenset({LOCALS}), minimum: int = 3,
         longest: int = 12) -> list[str]:
    """``lines``, a body's statements, with each run of at least ``minimum`` passes of the
    same statements as one ``for`` loop: the passes may differ only in names one pass
    hands the next, and in integers (alone or within strings) that move by the same step
    each pass. ``given``: the names the body is given (a function's parameters).

    The loop runs the same statements in the same order. A value handed from pass to
    pass keeps the name it had before the loop, and later code reads what the last pass
    left under that name; a ``del`` of a name that a pass has already set again is left
    to that assignment."""
    # one name per ``del`` (a last pass that frees more is the others and more), merged after
    statements = [one for st in _statements(lines) for one in (
        _statements([f"del {f.value}" for f in st.found]) if st.kind == "del" and
        len(st.found) > 1 and len(st.lines) == 1 else [st])]
    local = set(given) | {n for st in statements for n in st.defs}
    for at, st in enumerate(statements):
        st.at = at
        _analyse(st, local)
    live_after = _liveness(statements, set())
    keys = [(st.skeleton, tuple(type(v).__name__ for *_, v in st.literals)) for st in statements]
    everything = local | {f.value for st in statements for f in st.found if not f.literal}
    loops: list[_Loop] = []
    i = 0
    while i < len(statements):
        loop = None
        for p, r in _periods(keys, i, minimum, longest):
            loop = _Loop.of(statements, i, p, r, live_after, everything)
            if loop is not None:
                break
        if loop is None:
            i += 1
            continue
        loops.append(loop)
        i = loop.end
    def names(at: int, slots: list[str]) -> list[str]:
        for loop in reversed(loops):  # (a later loop's name for what it leaves first)
            if loop.end <= at < loop.stop:
                slots = [loop.renames.get(n, n) for n in slots]
        return slots

    out: list[str] = []
    starts = {loop.start: loop for loop in loops}
    i = 0
    while i < len(statements):
        if i in starts:
            loop = starts[i]
            out.append(loop.header)
            for st, slots, edits in loop.body:
                out += ["    " + line for line in _rendered(st, names(i, slots), edits)]
            i = loop.end
            continue
        st = statements[i]
        slots = [n for *_, n in st.names]
        renamed = names(i, slots)
        out += st.lines if renamed == slots else _rendered(st, renamed, {}, comments=True)
        i += 1
    return _merged_frees(out)


def _merged_frees(lines: list[str]) -> list[str]:
    """``lines`` with each run of ``del`` statements at one indent as one."""
    out: list[str] = []
    for line in lines:
        if out and line.lstrip().startswith("del ") and out[-1].lstrip().startswith("del ") \
                and len(line) - len(line.lstrip()) == len(out[-1]) - len(out[-1].lstrip()):
            out[-1] += ", " + line.lstrip()[4:]
        else:
            out.append(line)
    return out


def _periods(keys: list[tuple], i: int, minimum: int, longest: int
             ) -> list[tuple[int, int]]:
    """(period, passes) of the runs of repeated statements from ``i``: the longest first.
    A run starts at a statement that does something (a ``del`` ends what came before)."""
    found: list[tuple[int, int]] = []
    if keys[i][0].startswith((b"del ", b"#")):
        return found
    for p in range(1, longest + 1):
        block = keys[i:i + p]
        if len(block) < p:
            break
        r = 1
        while keys[i + r * p:i + (r + 1) * p] == block:
            r += 1
        found += [(p, n) for n in (r, r - 1) if n >= minimum]  # (the last pass may differ)
    return sorted(found, key=lambda pr: (-pr[0] * pr[1], pr[0]))


def _rendered(st: _Statement, names: list[str], literals: dict[int, str],
              comments: bool = False) -> list[str]:
    """``st`` with its name slots set to ``names`` and its literals ``literals`` (by
    index) written anew; without ``comments``, its trailing comment dropped. A ``del``
    of no names is no statement."""
    if st.kind == "del":
        kept = [n for n in names if n]
        indent = st.lines[0][:len(st.lines[0]) - len(st.lines[0].lstrip())]
        return [f"{indent}del {', '.join(kept)}"] if kept else []
    lines = list(st.lines)
    if not comments:
        lines = lines[:st.end[0] + 1]
        lines[-1] = lines[-1][:st.end[1]]
    edits = [(line, start, start + len(old), new)
             for (line, start, old), new in zip(st.names, names) if new != old]
    edits += [(line, start, end, literals[k])
              for k, (line, start, end, _) in enumerate(st.literals) if k in literals]
    return _edited(lines, edits)


@dataclass
class _Loop:
    """The run of repetitions from statement ``start`` up to ``end``, as a loop."""

    start: int
    header: str
    body: list[tuple[_Statement, list[str], dict[int, str]]]  # statement, names, literals
    renames: dict[str, str]  # a name the last pass leaves -> the loop's name for it
    end: int  # the statement after the run
    stop: int  # the renames hold for the statements from ``end`` up to this one

    @staticmethod
    def of(statements: list[_Statement], i: int, p: int, r: int, live_after: list[set[str]],
           taken: set[str]) -> _Loop | None:
        """The loop, or None where the passes do not run alike."""
        passes = [statements[i + k * p:i + (k + 1) * p] for k in range(r)]
        names = _loop_names(passes, live_after[i + r * p - 1])
        if names is None:
            return None
        canon, renames, kept = names
        end = i + r * p
        stop = next((k for k in range(end, len(statements))
                     if statements[k].defs & (set(renames) | set(renames.values()))),
                    len(statements))
        if stop < len(statements) and set(renames) & live_after[stop - 1]:
            return None  # (what the loop leaves, read after its name is set again)
        steps = any(f"{LOCALS}.micro(" in line or _LABEL.search(line)
                    for st in passes[0] for line in st.lines)  # (a loop over micro-batches)
        literals = _loop_literals(passes, _fresh("m" if steps else "i", taken))
        if literals is None:
            return None
        header, edits = literals
        labels = [[label for st in run for line in st.lines for label in _LABEL.findall(line)]
                  for run in (passes[0], passes[-1])]
        if all(labels):
            header += f"  # steps {', '.join(labels[0])} to {', '.join(labels[1])}"
        body = []
        for j, st in enumerate(passes[0]):
            if st.kind == "comment":
                continue
            slots = [c if keep else "" for c, keep in zip(canon[j], kept[j])]
            body.append((st, slots, edits[j]))
        if not any(st.kind != "del" for st, _, _ in body):
            return None
        return _Loop(i, header, body, renames, end, stop)


def _loop_names(passes: list[list[_Statement]], after: set[str]
                ) -> tuple[list[list[str]], dict[str, str], list[list[bool]]] | None:
    """Each name slot's loop name, the names the last pass leaves that later code must
    read under the loop's names, and whether each ``del`` slot stays; None where the loop
    would not read and free what the passes do (``after``: the names read after them).

    A value handed from pass to pass takes the name the first pass reads it by (from
    before the loop); any other value, the name the last pass gives it."""
    origins: list[list[list[tuple]]] = []  # per pass, statement, name slot: what it holds
    for k, run in enumerate(passes):
        now: dict[str, tuple] = {}
        before = _assignments(passes[k - 1]) if k else {}
        rows = []
        for j, st in enumerate(run):
            made = _assigned(st)
            row: list[tuple] = []
            for s, (*_, n) in enumerate(st.names):
                if all(other[j].names[s][2] == n for other in passes):
                    row.append(("same", n))
                elif s in made:
                    row.append(("set", j, s))
                elif n in now:
                    row.append(("set", *now[n]))
                elif n in before:
                    row.append(("carried", *before[n]))
                elif k == 0:
                    row.append(("entry",))
                else:
                    return None
            now.update((st.names[s][2], (j, s)) for s in made)
            rows.append(row)
        origins.append(rows)
    named: dict[tuple, str] = {}  # an assignment slot handed on -> the name it came in by
    for j, row in enumerate(origins[1]):
        for s, origin in enumerate(row):
            first = origins[0][j][s]
            if first != origin and not (first == ("entry",) and origin[0] == "carried"):
                return None
            if first == ("entry",) and \
                    named.setdefault(origin[1:], passes[0][j].names[s][2]) != \
                    passes[0][j].names[s][2]:
                return None
    canon = [[origin[1] if origin[0] == "same" else
              named.get(origin[1:], passes[-1][origin[1]].names[origin[2]][2])
              for origin in row] for row in origins[1]]
    renames = {passes[-1][j].names[s][2]: name for (j, s), name in named.items()}
    # run the passes as written and as the loop, each name to whichever value it holds
    written: dict[str, tuple] = {n: ("before", n) for n in named.values()}
    looped: dict[str, tuple] = dict(written)
    kept: list[list[bool]] = [[True] * len(st.names) for st in passes[0]]
    for k, run in enumerate(passes):
        for j, st in enumerate(run):
            made = _assigned(st)
            for s, (*_, n) in enumerate(st.names):
                c = canon[j][s]
                if st.kind == "del":
                    keep = looped.get(c) == written.get(n)
                    if k and kept[j][s] != keep:
                        return None
                    kept[j][s] = keep
                    written.pop(n, None)
                    if keep:
                        looped.pop(c, None)
                elif s not in made and looped.get(c) != written.get(n):
                    return None
            for s in made:
                written[st.names[s][2]] = looped[canon[j][s]] = (k, j, s)
    if any(looped.get(renames.get(n, n)) != written.get(n) for n in after) or \
            set(renames.values()) & after:
        return None  # (read after the loop: not what the last pass left under that name)
    return canon, renames, kept


def _assigned(st: _Statement) -> set[int]:
    """The name slots ``st`` assigns (each name's first slot: a target comes first)."""
    if st.kind == "del":
        return set()
    first: dict[str, int] = {}
    for s, (*_, n) in enumerate(st.names):
        first.setdefault(n, s)
    return {first[n] for n in st.defs if n in first}


def _assignments(run: list[_Statement]) -> dict[str, tuple[int, int]]:
    """Where ``run`` last assigns each name: (statement, slot)."""
    out: dict[str, tuple[int, int]] = {}
    for j, st in enumerate(run):
        out.update((st.names[s][2], (j, s)) for s in _assigned(st))
    return out


def _loop_literals(passes: list[list[_Statement]], var: str
                   ) -> tuple[str, list[dict[int, str]]] | None:
    """The loop's header and, per statement, its literals written in terms of the
    counter ``var`` (the first integer that differs between passes); None where one
    does not move by a fixed step that the counter's divides."""
    knobs: list[tuple[int, int, int | None, list[int]]] = []  # (j, literal, digit run, values)
    for j, st in enumerate(passes[0]):
        for q, (*_, value) in enumerate(st.literals):
            values = [run[j].literals[q][3] for run in passes]
            if all(v == value for v in values):
                continue
            if all(type(v) is int for v in values):
                knobs.append((j, q, None, values))
            elif all(type(v) is str for v in values):
                line, start, end, _ = st.literals[q]
                if st.lines[line][start:end] != repr(value):
                    return None  # (a part of an f-string, a string written otherwise)
                cut = [_DIGITS.split(v) for v in values]
                if any(len(c) != len(cut[0]) or c[0::2] != cut[0][0::2] for c in cut):
                    return None
                for u in range(1, len(cut[0]), 2):
                    runs = [c[u] for c in cut]
                    if len(set(runs)) > 1:
                        if any(d != str(int(d)) for d in runs):
                            return None  # (a leading zero)
                        knobs.append((j, q, u, [int(d) for d in runs]))
            else:
                return None
    edits: list[dict[int, str]] = [{} for _ in passes[0]]
    if not knobs:
        return f"for _ in range({len(passes)}):", edits
    counter = knobs[0][3]
    step = counter[1] - counter[0]
    if not step:
        return None
    written: dict[tuple[int, int, int | None], str] = {}
    for j, q, t, values in knobs:
        move = values[1] - values[0]
        if any(v != values[0] + move * k for k, v in enumerate(values)) or move % step:
            return None
        a = move // step
        written[(j, q, t)] = _affine(a, values[0] - a * counter[0], var)
    for (j, q, t), text in written.items():
        if t is None:
            edits[j][q] = text
            continue
        if q in edits[j]:
            continue
        value = passes[0][j].literals[q][3]
        parts = _DIGITS.split(value)
        template = "".join(
            ("{" + written[(j, q, u)] + "}" if (j, q, u) in written else part)
            if u % 2 else part.replace("{", "{{").replace("}", "}}")
            for u, part in enumerate(parts))
        edits[j][q] = "f" + repr(template)
    end = counter[0] + step * len(passes)
    bounds = f"{end}" if step == 1 and counter[0] == 0 else \
        f"{counter[0]}, {end}" if step == 1 else f"{counter[0]}, {end}, {step}"
    return f"for {var} in range({bounds}):", edits


def _affine(a: int, b: int, var: str) -> str:
    """``a * var + b``, written short."""
    term = var if a == 1 else f"-{var}" if a == -1 else f"{a} * {var}"
    return term if b == 0 else f"{term} + {b}" if b > 0 else f"{term} - {-b}"
