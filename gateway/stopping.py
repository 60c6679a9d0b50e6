"""Stop rules for one sequence, applied when a round's accepted drafts + bonus token are committed.

A round appends several tokens at once; the outcome must be what plain decoding would have
produced one token at a time: the sequence ends at the first token that is EOS or a stop token,
reaches `max_new_tokens`, or completes a stop string, and every token after it is dropped.
Streamed text never contains any part of a stop string: text that could be the start of one is
held back until the following tokens show whether it is.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.text import IncrementalDetokenizer


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_new_tokens generated


@dataclass(frozen=True)
class StopOutcome:
    text: str  # text to stream now (may be "")
    num_kept_tokens: int  # how many of the committed new tokens to keep; the rest are dropped
    finish_reason: FinishReason | None  # None: the sequence goes on


@dataclass(frozen=True)
class TokenOutcome:
    num_kept_tokens: int  # as StopOutcome's
    num_text_tokens: int  # the first kept tokens whose text is streamed: all but an EOS / stop
    finish_reason: FinishReason | None


class StopChecker:
    """Per-sequence stop state. The gateway's commit step is:

        outcome = seq.stop_checker.commit(new_ids)
        seq.tokens.extend(new_ids[: outcome.num_kept_tokens])
        stream(outcome.text); finish if outcome.finish_reason

    An EOS or stop token counts as generated (it is kept) but its text is not streamed.
    Without stop strings the rules need no text: commit_tokens, then text_of when streaming.
    """

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        *,
        eos_token_ids: Iterable[int],
        max_new_tokens: int,
        stop_token_ids: Iterable[int] = (),
        stop_strings: Sequence[str] = (),
        min_tokens: int = 0,
        include_stop_str: bool = False,
    ) -> None:
        """min_tokens: no stop token ends the sequence as one of its first min_tokens tokens, no
        stop string before it has that many (vLLM's; the verifier holds the stop tokens back).
        include_stop_str: the text ends with the stop string that ended it (vLLM's
        include_stop_str_in_output), not before it."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._detokenizer = detokenizer
        self._stop_token_ids = frozenset(eos_token_ids) | frozenset(stop_token_ids)
        self._stop_strings = tuple(stop_strings)
        self._max_new_tokens = max_new_tokens
        self._min_tokens = min_tokens
        self._include_stop_str = include_stop_str
        self.num_generated_tokens = 0
        self.finish_reason: FinishReason | None = None
        # Detokenized text not streamed yet: a suffix that may be the start of a stop string.
        self._held_text = ""

    @property
    def reads_text(self) -> bool:
        """Whether the rules read the text (stop strings): a round's outcome is then known only
        once its tokens are detokenized. Without, commit_tokens decides it from the ids."""
        return bool(self._stop_strings)

    def commit(self, new_ids: Sequence[int]) -> StopOutcome:
        """Apply the stop rules to the tokens generated this round (accepted drafts + bonus)."""
        rules = self._token_rules(new_ids)
        num_kept, finish = rules.num_kept_tokens, rules.finish_reason
        text_ids = new_ids[: rules.num_text_tokens]

        if self._stop_strings:
            # Token by token, so the sequence ends at the first token completing a stop string.
            for i, token in enumerate(text_ids):
                self._held_text += self._detokenizer.add([token])
                if self.num_generated_tokens + i + 1 < self._min_tokens:
                    continue
                if (stop_at := self._find_stop_string()) is not None:
                    return self._outcome(i + 1, self._take_held_text(stop_at), FinishReason.STOP)
        else:
            self._held_text += self._detokenizer.add(text_ids)

        if finish is None:
            num_streamed = len(self._held_text) - self._len_stop_prefix_suffix()
            return self._outcome(num_kept, self._take_held_text(num_streamed), None)
        # End of sequence: the held-back text is released (unless a stop string is in it).
        self._held_text += self._detokenizer.flush()
        if (stop_at := self._find_stop_string()) is not None:
            return self._outcome(num_kept, self._take_held_text(stop_at), FinishReason.STOP)
        return self._outcome(num_kept, self._take_held_text(len(self._held_text)), finish)

    def commit_tokens(self, new_ids: Sequence[int]) -> TokenOutcome:
        """The rules on the ids alone (EOS, stop tokens, max_new_tokens), for a checker without
        stop strings (not reads_text): the round's outcome, its text to follow with text_of
        (the scheduler streams it after the next round's first RPC is on its way)."""
        assert not self.reads_text, "stop strings need the text: commit()"
        rules = self._token_rules(new_ids)
        self._outcome(rules.num_kept_tokens, "", rules.finish_reason)
        return rules

    def text_of(self, text_ids: Sequence[int], finished: bool) -> str:
        """The text of a commit_tokens round's text tokens (its first num_text_tokens), rounds
        in order; at the finish also what the detokenizer held back. Without stop strings
        nothing else is held, so this is the text commit() streams."""
        text = self._detokenizer.add(text_ids)
        return text + self._detokenizer.flush() if finished else text

    def would_finish(self, new_ids: Sequence[int]) -> bool:
        """Whether committing `new_ids` next would finish the sequence by the token rules
        (length, an EOS or stop token id; stop strings not looked at); state unchanged. True
        once finished."""
        if self.finish_reason is not None:
            return True
        num_left = self._max_new_tokens - self.num_generated_tokens  # as _token_rules, quicker
        if len(new_ids) >= num_left:
            return True
        if self.num_generated_tokens + len(new_ids) <= self._min_tokens:
            return False  # (no stop token counts yet)
        return not self._stop_token_ids.isdisjoint(new_ids[self._first_stop_at() :])

    def _token_rules(self, new_ids: Sequence[int]) -> TokenOutcome:
        """The rules on the ids; state unchanged (the caller's _outcome records them)."""
        assert self.finish_reason is None, "commit() on a finished sequence"
        num_left = self._max_new_tokens - self.num_generated_tokens
        num_kept = min(len(new_ids), num_left)
        finish = FinishReason.LENGTH if num_kept == num_left else None
        num_text_tokens = num_kept  # the kept tokens whose text is streamed: all but EOS / stop
        for i, token in enumerate(new_ids[:num_kept]):
            if token in self._stop_token_ids and i >= self._first_stop_at():
                return TokenOutcome(i + 1, i, FinishReason.STOP)
        return TokenOutcome(num_kept, num_text_tokens, finish)

    def _first_stop_at(self) -> int:
        """The first index of a round's new tokens at which a stop token ends the sequence: the
        token after the first min_tokens."""
        return max(0, self._min_tokens - self.num_generated_tokens)

    def _outcome(self, num_kept: int, text: str, finish: FinishReason | None) -> StopOutcome:
        self.num_generated_tokens += num_kept
        assert self.num_generated_tokens <= self._max_new_tokens
        self.finish_reason = finish
        return StopOutcome(text=text, num_kept_tokens=num_kept, finish_reason=finish)

    def _take_held_text(self, end: int) -> str:
        """Stream the first `end` held chars; on a finish, the rest is simply never streamed."""
        text, self._held_text = self._held_text[:end], self._held_text[end:]
        return text

    def _find_stop_string(self) -> int | None:
        """Where the text to stream ends at the earliest stop string in the held text (its start,
        or its end with include_stop_str; the first listed of those starting there), or None."""
        found = [
            (i, n) for n, s in enumerate(self._stop_strings) if (i := self._held_text.find(s)) >= 0
        ]
        if not found:
            return None
        start, n = min(found)
        return start + len(self._stop_strings[n]) if self._include_stop_str else start

    def _len_stop_prefix_suffix(self) -> int:
        """Length of the longest suffix of the held text that is a prefix of a stop string."""
        return held_prefix_len(self._held_text, self._stop_strings)


def held_prefix_len(text: str, words: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `words`: what
    streamed text holds back until the next piece says whether the word follows."""
    return max((n for w in words for n in range(1, len(w)) if text.endswith(w[:n])), default=0)
