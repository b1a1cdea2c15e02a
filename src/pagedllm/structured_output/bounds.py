"""The size and depth bounds of a structured-output constraint, checked before llguidance sees it, and the
big-stack threads its compiles run on.

llguidance compiles a JSON schema's `$ref`s and a Lark grammar's rule references by native recursion: a
1,000-deep `$ref` chain, or 3,000 chained Lark rules, overflowed the 8 MiB stack of a Python thread and killed
the process (no exception can catch that). Measured on a thread with the default 8 MiB stack (llguidance 1.1,
x86-64), alike for the validation (no vocabulary) and the engine's compile (with one): a chain of object schemas
`d_i = {"properties": {"next": {"$ref": d_{i+1}}}}` crashes from ~900-930 links (~9 KiB of stack per link, ~3 KiB
per schema object on the path), a chain of Lark rules `r_i: "t" r_{i+1}` from ~2,650 rules (~3 KiB per rule). On
a 512 MiB stack 30,000 chained rules compile, and a 10,000-link chain reaches llguidance's own grammar-size limit
(an error, not a crash) before the stack's. So:

- every compile (the API's validation child, the offline validation pool, the engine's compile worker) runs on
  a thread with a STACK_BYTES stack (address space reserved, touched only as deep as it is used);
- a constraint is refused past the limits below, which keep the deepest recursion they allow (MAX_SCHEMA_DEPTH
  schema objects, MAX_RULE_DEPTH rules) at a few percent of that stack, while the sizes that worked on the 8 MiB
  stack (200-link chains, 2,000 chained rules) still pass.

Depths are measured without recursion (an explicit stack; Tarjan's strongly connected components), so a bound is
checked in linear time whatever the input: a cycle (a recursive schema or grammar, which llguidance compiles
once) counts as many steps as it has members, an upper bound of any path through it.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from typing import Any

MAX_SCHEMA_BYTES = 1 << 20
"""A JSON schema, as compact JSON."""
MAX_GRAMMAR_BYTES = 1 << 20
"""A Lark or GBNF grammar's text."""
MAX_REGEX_BYTES = 64 << 10
"""A regex's text."""
MAX_CHOICES = 20_000
"""Entries of a `choice`, or of one `enum` in a schema (20,000 short ones validate in ~0.5 s on one Zen 3 core,
100,000 in ~19 s: the compile time grows faster than the count)."""
MAX_CHOICE_BYTES = 1 << 20
"""A `choice`'s entries together (UTF-8)."""
MAX_SCHEMA_NESTING = 100
"""Nested JSON objects and arrays in a schema document (llguidance's own JSON reader stops at 128 levels, with
an error naming neither field nor limit; deeper ones crashed it before that)."""
MAX_REF_DEPTH = 500
"""`$ref`s followed one after the other (a chain d0 -> d1 -> ... counts its links)."""
MAX_SCHEMA_DEPTH = 5_000
"""Schema objects on one path through the schema, following `$ref`s (~15 MiB of compile stack at most)."""
MAX_GRAMMAR_RULES = 5_000
"""Rules (and terminals) of a Lark grammar."""
MAX_RULE_DEPTH = 2_500
"""Rules on one chain of rule references (~8 MiB of compile stack at most)."""
SMALL_GRAMMAR_BYTES = 32 << 10
"""Grammars up to this size (llguidance's text: a schema of a few hundred properties, a choice of ~1,500 entries;
milliseconds to compile) are compiled apart from bigger ones, so that they never queue behind them (the API's
validation children and the engine's compile workers)."""
STACK_BYTES = 512 << 20
"""The stack of every thread that compiles a grammar."""

_stack_size_lock = threading.Lock()


class ConstraintLimitError(ValueError):
    """A constraint past one of the limits above; the message names the limit and its value."""


def _over(what: str, value: int, limit: int, unit: str = "") -> ConstraintLimitError:
    return ConstraintLimitError(f"{what} is {value:,}{unit}, over this server's limit of {limit:,}{unit}.")


def check_bytes(what: str, text: str, limit: int) -> None:
    """Raises ConstraintLimitError when `text` is longer than `limit` bytes in UTF-8 (a lone surrogate counts
    as 3)."""
    if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
        raise _over(f"The {what}'s size", len(text.encode("utf-8", "surrogatepass")), limit, " bytes")


def check_choice(choices: list[str]) -> None:
    if len(choices) > MAX_CHOICES:
        raise _over("The number of choice entries", len(choices), MAX_CHOICES)
    size = sum(len(c.encode("utf-8", "surrogatepass")) for c in choices)
    if size > MAX_CHOICE_BYTES:
        raise _over("The size of the choice entries", size, MAX_CHOICE_BYTES, " bytes")


def check_schema(schema: Any) -> None:
    """Raises ConstraintLimitError for a JSON schema past MAX_SCHEMA_BYTES, MAX_SCHEMA_NESTING, MAX_CHOICES (one
    `enum`), MAX_REF_DEPTH or MAX_SCHEMA_DEPTH. Local `$ref`s (`#`, `#/json/pointer`) are followed; others are
    left to llguidance (which refuses them)."""
    nodes: list[dict] = []  # every JSON object of the document, parents first
    children: dict[int, list[int]] = {}  # id(object) -> ids of the objects directly inside it (through arrays)
    stack: list[tuple[Any, int, int]] = [(schema, 1, -1)]  # (value, nesting, id of the enclosing object)
    while stack:
        value, nesting, parent = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        if nesting > MAX_SCHEMA_NESTING:
            raise _over("The JSON schema's nesting (objects and arrays inside each other)", nesting,
                        MAX_SCHEMA_NESTING)
        if isinstance(value, dict):
            if parent != -1:
                children[parent].append(id(value))
            nodes.append(value)
            children[id(value)] = []
            enum = value.get("enum")
            if isinstance(enum, list) and len(enum) > MAX_CHOICES:
                raise _over("The number of entries of an enum", len(enum), MAX_CHOICES)
            parent = id(value)
            items: Iterable = value.values()
        else:
            items = value
        stack.extend((item, nesting + 1, parent) for item in items)
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False, default=str).encode(
        "utf-8", "surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise _over("The JSON schema's size", size, MAX_SCHEMA_BYTES, " bytes")
    refs: set[int] = set()
    for node in nodes:
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _pointer(schema, ref)
            if isinstance(target, dict):
                children[id(node)].append(id(target))
                refs.add(id(node))
    if not refs:
        return  # a tree: its depth is within its nesting
    ref_depth, depth = _longest_paths(children, [id(node) for node in nodes],
                                      (lambda n: 1 if n in refs else 0, lambda n: 1))
    if ref_depth > MAX_REF_DEPTH:
        raise _over("The JSON schema's $ref chain depth ($refs followed one after the other)", ref_depth,
                    MAX_REF_DEPTH)
    if depth > MAX_SCHEMA_DEPTH:
        raise _over("The JSON schema's depth (schema objects on one path, following $refs)", depth,
                    MAX_SCHEMA_DEPTH)


def _pointer(document: Any, ref: str) -> Any:
    """The value `ref` ("#" or "#/a/b/0", a JSON pointer in a URI fragment) points to in `document`; None for
    any other reference or a pointer to nothing."""
    if not ref.startswith("#"):
        return None
    path = ref[1:]
    if path and not path.startswith("/"):
        return None  # an anchor ("#name"): not followed
    value = document
    for token in path.split("/")[1:]:
        token = re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), token)
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict):
            value = value.get(token)
        elif isinstance(value, list) and token.isdigit() and int(token) < len(value):
            value = value[int(token)]
        else:
            return None
    return value


_LARK_NOT_NAMES = re.compile(r'//[^\n]*|"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*')
"""A comment, a string literal or a regex: whichever starts first (`"http://..."` is a string)."""
_LARK_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?[ \t]*:", re.MULTILINE)
_LARK_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_lark(grammar: str) -> None:
    """Raises ConstraintLimitError for a Lark grammar (as llguidance takes it) with more than MAX_GRAMMAR_RULES
    rules or a chain of rule references deeper than MAX_RULE_DEPTH (a rule referring to another counts one
    step; literals, regexes and comments are not references)."""
    text = _LARK_NOT_NAMES.sub(" ", grammar)
    starts = list(_LARK_RULE.finditer(text))
    if len(starts) > MAX_GRAMMAR_RULES:
        raise _over("The number of grammar rules", len(starts), MAX_GRAMMAR_RULES)
    bodies: dict[str, list[str]] = {}
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        bodies.setdefault(match.group(1), []).append(text[match.end():end])
    edges = {name: list({ref for body in parts for ref in _LARK_NAME.findall(body) if ref in bodies})
             for name, parts in bodies.items()}
    (depth,) = _longest_paths(edges, list(edges), (lambda n: 1,))
    if depth > MAX_RULE_DEPTH:
        raise _over("The grammar's rule-reference depth (rules on one chain of references)", depth, MAX_RULE_DEPTH)


def _longest_paths(edges: dict[Hashable, list], nodes: list, weights: tuple[Callable[[Hashable], int], ...]
                   ) -> tuple[int, ...]:
    """For each weight, the heaviest path of the graph (`edges`: node -> successors), a strongly connected
    component weighing the sum of its members (so a cycle is counted once, in full). Iterative Tarjan: each
    component is finished after every component it reaches, so its best path is known from theirs."""
    index: dict[Hashable, int] = {}
    low: dict[Hashable, int] = {}
    on_stack: set = set()
    component_stack: list = []
    component_of: dict[Hashable, int] = {}
    best: list[tuple[int, ...]] = []  # per component: the heaviest path starting in it, per weight
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(edges.get(root, ())))]
        index[root] = low[root] = len(index)
        component_stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    component_stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(edges.get(succ, ()))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = component_stack.pop()
                    on_stack.discard(member)
                    component_of[member] = len(best)
                    members.append(member)
                    if member == node:
                        break
                number = len(best)
                after = [0] * len(weights)
                for member in members:
                    for succ in edges.get(member, ()):
                        other = component_of[succ]
                        if other != number:
                            after = [max(a, b) for a, b in zip(after, best[other], strict=True)]
                best.append(tuple(sum(w(m) for m in members) + a for w, a in zip(weights, after, strict=True)))
    return tuple(max((b[i] for b in best), default=0) for i in range(len(weights)))


COMPILE_NICE = 10
"""How far the engine's grammar compiles lower their thread's priority. On a machine whose cores all run the
model's threads, a 2,000-branch schema's compile (~0.6 s of a core) stretched every step it overlapped: a
neighbour stream's longest gap 0.135 s at nice 0, 0.02 s at 19 (benchmarks/structured_outputs_mask_cost.py
--engine). 10 (a tenth of a core's share against a busy thread, not 19's 1.5%) keeps a compile from starving
when the machine is loaded by other work: the big constraint slows its own request."""


class BigStackExecutor:
    """A one-thread executor whose thread has a STACK_BYTES stack (ThreadPoolExecutor's threads get the
    process's default, 8 MiB). `submit` returns a concurrent.futures.Future.

    `nice` > 0 lowers the thread's scheduling priority (a Linux thread has its own nice value): see COMPILE_NICE."""

    def __init__(self, name: str, stack_bytes: int = STACK_BYTES, nice: int = 0):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._nice = nice
        with _stack_size_lock:  # threading.stack_size is process-wide: set it for this thread's start only
            previous = threading.stack_size(stack_bytes)
            try:
                self._thread = threading.Thread(target=self._run, name=name, daemon=True)
                self._thread.start()
            finally:
                threading.stack_size(previous)

    def submit(self, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        if self._nice:
            lower_priority(self._nice)
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, as ThreadPoolExecutor does
                future.set_exception(e)

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """Stop after the running call; with cancel_futures, the queued ones are cancelled."""
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        self._queue.put(None)
        if wait:
            self._thread.join()


def lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by `nice` (Linux; best effort elsewhere)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except (AttributeError, OSError):
        pass
