"""Compile a regular expression (a subset of Python `re` syntax: see `regex_parse`) to a DFA over
UTF-8 bytes, for guided decoding: a token keeps the output matchable when walking its bytes from
the current state does not die.

`compile_regex(p).matches(text) == (re.fullmatch(p, text) is not None)` for every supported
pattern and text, except that `\\d \\w \\s` (and their negations) have their ASCII meanings, as
under `re.ASCII`. Characters are matched as their UTF-8 byte sequences: a class becomes exactly
the valid encodings of its code points (surrogates are never characters), so no invalid UTF-8
is ever accepted.

Construction: parse -> Thompson NFA with byte-range edges -> subset construction over bytes ->
states that cannot reach an accepting state dropped (their transitions become -1) -> Hopcroft's
partition refinement over the kinds of bytes that act alike -> renumbered breadth-first from the
start, which is 0. Every state of the result can reach an accepting state, except the start
state of a pattern that matches nothing (one state, not accepting, every transition -1).

Limits: the subset construction stops with a ValueError past `max_states` DFA states, and the NFA
past `NFA_STATES_PER_DFA_STATE * max_states` states (large repeat counts, e.g. `[^"]{5000}`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from specsplit.guide.regex_parse import Alt, Chars, Concat, Node, Ranges, Repeat, parse

MAX_STATES = 10_000  # the default cap on DFA states
NFA_STATES_PER_DFA_STATE = 10  # the NFA's cap, per DFA state allowed

ByteSeq = tuple[tuple[int, int], ...]  # inclusive byte ranges, one per byte of an encoding


@dataclass(frozen=True, eq=False)
class ByteDFA:
    """A DFA over bytes whose start state is 0. Compared by identity (it holds arrays)."""

    transitions: np.ndarray  # int32 [num_states, 256]: next state per byte; -1 = dead
    accepting: np.ndarray  # bool [num_states]: a match may end here

    def __post_init__(self) -> None:
        n = len(self.accepting)
        if self.transitions.shape != (n, 256) or self.accepting.dtype != np.bool_ or n < 1:
            raise ValueError(
                f"a ByteDFA needs transitions [n, 256] and accepting bool [n], n >= 1; got "
                f"{self.transitions.shape} and {self.accepting.dtype} {self.accepting.shape}"
            )

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    def walk(self, data: bytes, state: int = 0) -> int:
        """The state after `data` from `state`; -1 once dead (and for a dead `state`)."""
        table = self.transitions
        for byte in data:
            if state < 0:
                return -1
            state = int(table[state, byte])
        return state

    def matches(self, text: str) -> bool:
        """Whether the whole of `text`'s UTF-8 bytes is matched (lone surrogates never are)."""
        state = self.walk(text.encode("utf-8", "surrogatepass"))
        return state >= 0 and bool(self.accepting[state])


def compile_regex(pattern: str, max_states: int = MAX_STATES) -> ByteDFA:
    """The minimal byte-level DFA of `pattern` (module doc). ValueError, naming the construct and
    its position, for syntax outside the supported subset, or when the DFA would pass
    `max_states` states (the subset construction's, before minimization)."""
    try:
        tree = parse(pattern)
        nfa = _Nfa(NFA_STATES_PER_DFA_STATE * max_states)
        start, final = nfa.new_state(), nfa.new_state()
        nfa.build(tree, start, final)
    except RecursionError:
        raise ValueError(f"regex {pattern[:80]!r} is nested too deeply") from None
    transitions, accepting = _determinize(nfa, start, final, max_states)
    transitions, accepting = _drop_dead(transitions, accepting)
    if accepting.any():  # else the one dead start state
        transitions, accepting = _renumber(*_minimize(transitions, accepting))
    transitions.flags.writeable = False
    accepting.flags.writeable = False
    return ByteDFA(transitions, accepting)


def utf8_sequences(lo: int, hi: int) -> list[ByteSeq]:
    """The byte-range sequences whose strings are exactly the UTF-8 encodings of code points
    lo..hi (no surrogates among them): the range is split until both ends encode to the same
    length and all but the first bytes cover their full 80-BF span within each piece, as in Rust's
    regex-syntax utf8 module and RE2."""
    out: list[ByteSeq] = []
    stack = [(lo, hi)]
    while stack:
        lo, hi = stack.pop()
        halves = _split(lo, hi)
        if halves is None:
            out.append(tuple(zip(chr(lo).encode(), chr(hi).encode(), strict=True)))
        else:
            stack.extend(reversed(halves))
    return out


def _split(lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """lo..hi cut in two where its encodings differ in length or in a leading byte with a partial
    tail; None when lo..hi is one byte-range sequence already."""
    for top in (0x7F, 0x7FF, 0xFFFF):  # the last code point of each encoded length
        if lo <= top < hi:
            return (lo, top), (top + 1, hi)
    if hi <= 0x7F:
        return None
    for i in (1, 2, 3):
        tail = (1 << (6 * i)) - 1  # the code-point bits of the last i bytes
        if lo & ~tail != hi & ~tail:
            if lo & tail:
                return (lo, lo | tail), ((lo | tail) + 1, hi)
            if hi & tail != tail:
                return (lo, (hi & ~tail) - 1), (hi & ~tail, hi)
    return None


class _Nfa:
    """A Thompson NFA: state i has epsilon moves `eps[i]` and byte moves `edges[i]`, each
    (lo, hi, target) for the bytes lo..hi. `build(node, src, dst)` adds paths src -> dst that
    spell the node's strings, only ever adding moves out of src, into dst, or among new states,
    so sub-automata sharing src or dst never leak into each other."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[int, int, int]]] = []

    def new_state(self) -> int:
        if len(self.eps) >= self.cap:
            raise self.too_many()
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def too_many(self) -> ValueError:
        return ValueError(
            f"regex needs more than {self.cap} NFA states (a repeat count too large?)"
        )

    def build(self, node: Node, src: int, dst: int) -> None:
        if isinstance(node, Chars):
            self.chars(node.ranges, src, dst)
        elif isinstance(node, Alt):
            for item in node.items:
                self.build(item, src, dst)
        elif isinstance(node, Concat):
            self.chain([*node.items], src, dst)
        else:
            self.repeat(node, src, dst)

    def chain(self, items: list[Node], src: int, dst: int) -> None:
        """The items one after another from src to dst."""
        at = src
        for item in items:
            nxt = self.new_state()
            self.build(item, at, nxt)
            at = nxt
        self.eps[at].append(dst)

    def repeat(self, node: Repeat, src: int, dst: int) -> None:
        if max(node.low, node.high or 0) > self.cap:  # each copy takes a state at least
            raise self.too_many()
        at = src
        for _ in range(node.low):  # the required copies
            nxt = self.new_state()
            self.build(node.item, at, nxt)
            at = nxt
        if node.high is None:  # then a loop: at -> loop -(item)-> back -> loop -> dst
            loop, back = self.new_state(), self.new_state()
            self.eps[at].append(loop)
            self.build(node.item, loop, back)
            self.eps[back].append(loop)
            self.eps[loop].append(dst)
            return
        for _ in range(node.high - node.low):  # optional copies, nested: each may end it
            self.eps[at].append(dst)
            nxt = self.new_state()
            self.build(node.item, at, nxt)
            at = nxt
        self.eps[at].append(dst)

    def chars(self, ranges: Ranges, src: int, dst: int) -> None:
        """One character of `ranges`: a trie of byte-range moves over its UTF-8 sequences."""
        made: dict[ByteSeq, int] = {}  # a sequence's prefix: the state after it
        for lo, hi in ranges:
            for seq in utf8_sequences(lo, hi):
                at = src
                for k, (blo, bhi) in enumerate(seq[:-1]):
                    prefix = seq[: k + 1]
                    if prefix not in made:
                        made[prefix] = self.new_state()
                        self.edges[at].append((blo, bhi, made[prefix]))
                    at = made[prefix]
                self.edges[at].append((*seq[-1], dst))


def _determinize(
    nfa: _Nfa, start: int, final: int, max_states: int
) -> tuple[np.ndarray, np.ndarray]:
    """Subset construction over bytes: transitions int32 [n, 256] (-1: no move) and accepting
    bool [n], state 0 the start's closure. A DFA state is the set of NFA states with byte moves
    (or `final`) in an epsilon closure."""
    closures: dict[int, frozenset[int]] = {}

    def closure(state: int) -> frozenset[int]:
        if state not in closures:
            seen, stack = {state}, [state]
            while stack:
                for nxt in nfa.eps[stack.pop()]:
                    if nxt not in seen:
                        seen.add(nxt)
                        stack.append(nxt)
            closures[state] = frozenset(s for s in seen if nfa.edges[s] or s == final)
        return closures[state]

    sets = [closure(start)]
    ids = {sets[0]: 0}
    moves: list[tuple[int, int, int, int]] = []  # (state, first byte, past last byte, next)
    for i, current in enumerate(sets):  # grows as new sets are found
        for lo, end, targets in _byte_moves([e for s in current for e in nfa.edges[s]]):
            nxt = frozenset().union(*(closure(t) for t in targets))
            if nxt not in ids:
                if len(sets) >= max_states:
                    raise ValueError(f"regex's DFA would pass max_states={max_states} states")
                ids[nxt] = len(sets)
                sets.append(nxt)
            moves.append((i, lo, end, ids[nxt]))
    transitions = np.full((len(sets), 256), -1, dtype=np.int32)
    for i, lo, end, nxt_id in moves:
        transitions[i, lo:end] = nxt_id
    return transitions, np.array([final in s for s in sets], dtype=np.bool_)


def _byte_moves(edges: list[tuple[int, int, int]]) -> list[tuple[int, int, set[int]]]:
    """The edges' bytes cut into spans [lo, end) that lead to one set of targets each."""
    cuts = sorted({lo for lo, _, _ in edges} | {hi + 1 for _, hi, _ in edges})
    spans = []
    for lo, end in itertools.pairwise(cuts):
        targets = {t for elo, ehi, t in edges if elo <= lo <= ehi}
        if targets:
            spans.append((lo, end, targets))
    return spans


def _drop_dead(transitions: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The states that can reach an accepting state, moves to the others -1; the start stays
    state 0 (alone, and dead, if it cannot reach one)."""
    n = len(accepting)
    src = np.repeat(np.arange(n, dtype=np.int64), 256)
    dst = transitions.ravel().astype(np.int64)
    keep = dst >= 0
    pairs = np.unique(dst[keep] * n + src[keep])  # reversed moves (dst, src), sorted by dst
    preds, starts = (pairs % n).tolist(), np.searchsorted(pairs // n, np.arange(n + 1)).tolist()
    live = accepting.copy()
    stack = np.flatnonzero(accepting).tolist()
    while stack:
        s = stack.pop()
        for p in preds[starts[s] : starts[s + 1]]:
            if not live[p]:
                live[p] = True
                stack.append(p)
    if not live[0]:
        return np.full((1, 256), -1, dtype=np.int32), np.zeros(1, dtype=np.bool_)
    new_id = np.full(n + 1, -1, dtype=np.int32)  # old state (or -1, the last entry): new id
    new_id[np.flatnonzero(live)] = np.arange(int(live.sum()), dtype=np.int32)
    return new_id[transitions[live]], accepting[live]


def _minimize(transitions: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hopcroft's partition refinement over the kinds of bytes (the distinct columns), with the
    dead moves sent to a sink state `n` that is a block of its own (every other state can reach
    an accepting state); one state per block, state 0's block first."""
    n = len(accepting)
    _, byte_reps = np.unique(transitions, axis=1, return_index=True)  # a byte per column kind
    succ = np.vstack([transitions[:, byte_reps], np.full((1, len(byte_reps)), -1)])
    succ[succ < 0] = n  # [n + 1, kinds]: the sink's moves stay in it
    block_of, members = _refine(succ, np.append(accepting, False))
    blocks = np.array(block_of)  # [n + 1]
    reps = np.sort(np.unique(blocks, return_index=True)[1])[:-1]  # each block's first state
    new_id = np.full(len(members), -1, dtype=np.int32)  # block: its index (the sink's: -1)
    new_id[blocks[reps]] = np.arange(len(reps), dtype=np.int32)
    return np.append(new_id[blocks[:n]], np.int32(-1))[transitions[reps]], accepting[reps]


def _refine(succ: np.ndarray, accepting: np.ndarray) -> tuple[list[int], list[set[int]]]:
    """Hopcroft: each state's block and each block's states, for the coarsest partition that
    splits accepting from not and that every kind of byte maps block-wise."""
    # per kind of byte: the states sorted by their successor, and where each successor's run starts
    preds: list[tuple[list[int], list[int]]] = []
    for column in succ.T:
        by_succ = np.argsort(column, kind="stable")
        starts = np.searchsorted(column[by_succ], np.arange(len(succ) + 1))
        preds.append((by_succ.tolist(), starts.tolist()))
    members = [set(np.flatnonzero(accepting).tolist()), set(np.flatnonzero(~accepting).tolist())]
    block_of = [0 if a else 1 for a in accepting.tolist()]
    pending = [0 if len(members[0]) <= len(members[1]) else 1]  # the splitters still to use
    while pending:
        splitter = list(members[pending.pop()])
        for order, runs in preds:
            touched: dict[int, list[int]] = {}  # block: its states moving into the splitter
            for t in splitter:
                for s in order[runs[t] : runs[t + 1]]:
                    touched.setdefault(block_of[s], []).append(s)
            for b, inside in touched.items():
                if len(inside) < len(members[b]):
                    pending.append(_split_block(members, block_of, b, inside))
    return block_of, members


def _split_block(members: list[set[int]], block_of: list[int], b: int, inside: list[int]) -> int:
    """Block b split into `inside` and the rest, the smaller part a new block, whose index is
    returned (Hopcroft: enough as the next splitter, whether or not b still is one). Costs the
    size of `inside`, at least half of the smaller part."""
    inside_set = set(inside)
    if 2 * len(inside_set) <= len(members[b]):
        small = inside_set
        members[b] -= small
    else:
        small = members[b] - inside_set
        members[b] = inside_set
    members.append(small)
    for s in small:
        block_of[s] = len(members) - 1
    return len(members) - 1


def _renumber(transitions: np.ndarray, accepting: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """States renumbered in breadth-first order from the start (block of state 0 -> 0)."""
    rows = transitions.tolist()
    order, seen = [0], {0}
    for s in order:  # grows as states are found
        for t in dict.fromkeys(rows[s]):
            if t >= 0 and t not in seen:
                seen.add(t)
                order.append(t)
    new_id = np.full(len(accepting) + 1, -1, dtype=np.int32)  # the last entry: -1 stays -1
    new_id[order] = np.arange(len(order), dtype=np.int32)
    return new_id[transitions[order]], accepting[order]
