"""A guide's byte-level DFA (specsplit/guide/regex_dfa.py) walked a token at a time over a
vocabulary (specsplit/guide/vocab.py): per DFA state the tokens that keep the output matchable,
as a packed bit mask the verifier applies to a row's logits, and the state each token leads to.

The output ends with one of the `end_ids` (EOS, the stop ids), allowed where the text so far is a
whole match. Special tokens and empty ones never match text. A state past the end, or past a token
no match could take (a draft the verifier will reject), has no mask: its rows are never used."""

from __future__ import annotations

import numpy as np

from specsplit.guide.regex_dfa import ByteDFA
from specsplit.logit_rules import distinct, pack_mask
from specsplit.tree import DraftTree

DEAD = -1  # past a token no match could take
ENDED = -2  # past an end token


class TokenGuide:
    """What a sequence's rounds walk: a state per output prefix (0 at the start), the tokens
    allowed at each (`allowed_at`; as a mask, made once a state: `mask`) and the state each
    leads to (`step`)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._masks: dict[int, np.ndarray] = {}

    def allowed_at(self, state: int) -> np.ndarray:
        """[vocab] bool: the tokens allowed at `state` (>= 0)."""
        raise NotImplementedError

    def mask(self, state: int) -> np.ndarray | None:
        """The tokens allowed at `state` as uint32 words [mask_words(vocab)]; None past the end or
        past a refused token (its rows are never accepted from)."""
        if state < 0:
            return None
        words = self._masks.get(state)
        if words is None:
            words = self._masks[state] = pack_mask(self.allowed_at(state))
        return words

    def step(self, state: int, token: int) -> int:
        raise NotImplementedError

    def walk(self, state: int, tokens: list[int]) -> int:
        for token in tokens:
            state = self.step(state, token)
        return state

    def row_states(self, state: int, tree: DraftTree) -> list[int]:
        """The states of a round's rows from `state` (the output's, through the pending token):
        the root's, then each node's after the path to it (parents come first)."""
        states = [state]
        for token, parent in zip(tree.tokens, tree.parents, strict=True):
            states.append(self.step(states[parent + 1], token))
        return states


class FixedTokens(TokenGuide):
    """The same tokens allowed at every place (vLLM's allowed_token_ids): one state."""

    def __init__(self, allowed: tuple[int, ...], vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.allowed = frozenset(allowed)

    def allowed_at(self, state: int) -> np.ndarray:
        bits = np.zeros(self.vocab_size, dtype=bool)
        bits[list(self.allowed)] = True
        return bits

    def step(self, state: int, token: int) -> int:
        return state if state < 0 or token in self.allowed else DEAD


class TokenTable:
    """A vocabulary's token bytes laid out for walking every token at once (made once a
    vocabulary, shared by its guides): the tokens with text, longest first, their bytes padded
    [U, longest], and per byte position how many tokens reach it."""

    def __init__(self, vocab: list[bytes | None]) -> None:
        self.vocab = vocab
        usable = [i for i, raw in enumerate(vocab) if raw]
        usable.sort(key=lambda i: -len(vocab[i] or b""))  # longest first: byte k's tokens lead
        lengths = np.array([len(vocab[i] or b"") for i in usable], dtype=np.int64)
        self.ids = np.array(usable, dtype=np.int64)  # [U]
        self.bytes = np.zeros((len(usable), int(lengths.max(initial=0))), dtype=np.uint8)
        for row, i in enumerate(usable):
            raw = vocab[i] or b""
            self.bytes[row, : len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        self.num_longer = [int(np.sum(lengths > k)) for k in range(self.bytes.shape[1])]


class TokenAutomaton(TokenGuide):
    """`dfa` over the tokens of `vocab` (per id its bytes, None: never text; or its TokenTable);
    masks are made once per state, as rows visit it."""

    def __init__(
        self, dfa: ByteDFA, vocab: list[bytes | None] | TokenTable, end_ids: tuple[int, ...]
    ) -> None:
        if not end_ids:
            raise ValueError("guided decoding needs an end token (EOS or a stop token id)")
        self.tokens = vocab if isinstance(vocab, TokenTable) else TokenTable(vocab)
        super().__init__(len(self.tokens.vocab))
        self.dfa = dfa
        self.vocab = self.tokens.vocab
        self.end_ids = distinct(end_ids)
        # the transitions with a sink state for dead ones: [num_states + 1, 256]
        sink = dfa.num_states
        self._table = np.vstack([dfa.transitions, np.full((1, 256), sink, dtype=np.int32)])
        self._table[self._table < 0] = sink

    def next_states(self, state: int) -> np.ndarray:
        """[vocab] int32: the state after each token from `state`, DEAD where none (ENDED for the
        end tokens where a match may end)."""
        assert 0 <= state < self.dfa.num_states, state
        table = self.tokens
        states = np.full(len(table.ids), state, dtype=np.int32)
        for k, n in enumerate(table.num_longer):
            states[:n] = self._table[states[:n], table.bytes[:n, k]]
        out = np.full(self.vocab_size, DEAD, dtype=np.int32)
        out[table.ids] = np.where(states == self.dfa.num_states, DEAD, states)
        # the end tokens end the output (never text), where it is a whole match
        out[list(self.end_ids)] = ENDED if self.dfa.accepting[state] else DEAD
        return out

    def allowed_at(self, state: int) -> np.ndarray:
        """The tokens next_states leads somewhere. A state no token can leave (a vocabulary
        lacking a character the pattern needs) allows the end tokens: the output ends unmatched
        rather than nowhere."""
        allowed = self.next_states(state) != DEAD
        if not allowed.any():
            allowed[list(self.end_ids)] = True
        return allowed

    def step(self, state: int, token: int) -> int:
        """The state after `token` from `state` (DEAD, ENDED as next_states says)."""
        if state < 0:
            return state
        if token in self.end_ids:
            return ENDED if self.dfa.accepting[state] else DEAD
        raw = self.vocab[token] if 0 <= token < self.vocab_size else None
        if not raw:
            return DEAD
        after = self.dfa.walk(raw, state)
        return DEAD if after < 0 else after
