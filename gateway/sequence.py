"""Per-request state on the gateway: the authoritative `tokens` and what each service holds."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.adaptive import AdaptiveSpec
from gateway.features import FeatureRows
from gateway.guides import round_allowed
from gateway.request import Chunk, GenerationRequest, SpecStats
from gateway.stopping import StopChecker
from specsplit.guide.tokens import DEAD
from specsplit.logit_rules import LogitRules, Penalties, round_rules, start_context
from specsplit.messages import (
    NO_LOGPROBS,
    AheadTree,
    DraftInput,
    DraftRules,
    SpecParams,
    TokenLogprobs,
    VerifyInput,
    VerifyOutput,
)
from specsplit.tree import DraftTree


class SessionTurn(Protocol):
    """What a sequence knows of the session turn it is (gateway/session_state.py:Turn)."""

    reply_parts: list[str]  # the text streamed to the client


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request: GenerationRequest
    spec: SpecParams
    stop_checker: StopChecker
    tokens: list[int] = field(default_factory=list)  # prompt + generated, authoritative
    num_prompt_tokens: int = 0
    verifier_kv_committed_len: int = 0  # what the verifier holds
    verifier_begun: bool = False
    # this round the speculation gate holds its drafts back (gateway/gate.py): plain decoding,
    # without the drafter's target features (features_gap: some committed tokens have none)
    drafts_held: bool = False
    features_gap: bool = False
    # rounds committed since the verifier began (or re-verified) its tokens: the first is that
    # prefill, the second the drafter's catch-up of them; the gate measures from the third
    rounds_since_prefill: int = 0
    drafter_num_tokens: int = 0  # leading tokens the drafter holds
    drafter_begun: bool = False
    stats: SpecStats = field(default_factory=SpecStats)
    outbox: asyncio.Queue[Chunk | BaseException] = field(default_factory=asyncio.Queue)
    finished: bool = False
    cancelled: bool = False
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    finish_reason: str | None = None  # "stop" or "length" once finished
    last_token_ns: int | None = None  # elapsed_ns of the last chunk with tokens (metrics)
    span: Any = None  # the request's trace span (specsplit.telemetry)
    # EAGLE drafters: target layers the verifier returns, and their rows for the tokens from
    # the drafter's start to verifier_kv_committed_len (gateway/features.py)
    hidden_state_layers: tuple[int, ...] = ()
    features: FeatureRows = field(default_factory=FeatureRows)
    adaptive: AdaptiveSpec | None = None  # adaptive speculation: the draft shape, round by round
    turn: SessionTurn | None = None  # a session's turn (gateway/sessions.py)
    # draft-ahead: trees for the next round by the outcome of this one (the tokens it appends),
    # drafted while it was verified; valid for the round after `ahead_round` only
    ahead: dict[tuple[int, ...], DraftTree] = field(default_factory=dict)
    ahead_round: int = -1
    ahead_base: int = 0  # len(tokens) when they were drafted

    # with the request's penalties (specsplit/logit_rules.py): what each round's rules read,
    # the prompt's distinct tokens and the output's counts so far (`LogitRules.after`)
    rules_context: LogitRules | None = None
    # whether the verifier keeps that context as the last round left it (`verify_input` then
    # says so in place of sending it: verifier/kept_rules.py); its last round's rules were sent
    rules_kept: bool = False
    rules_sent: bool = False
    # whether the drafter holds this turn's logit rules (`draft_input` sends them once)
    drafter_rules_sent: bool = False
    guide_state: int = 0  # with a guide: its automaton's state after the output so far
    # the prompt's log-probabilities, once the first round brought them (where asked)
    prompt_logprobs: TokenLogprobs | None = None
    # a run of tokens the verifier lacks longer than this goes this many a round (`prefilling`;
    # 0: in one round)
    prefill_chunk: int = 0
    chunked: bool = False  # chunk rounds committed since the last round that drew its tokens

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.request.prompt_ids)
            self.num_prompt_tokens = len(self.tokens)
        self.rules_context = start_context(self.request.penalties, self.request.prompt_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def prefilling(self) -> bool:
        """Whether the verifier lacks more of the tokens than one round takes (prefill_chunk: a
        long prompt, or a sequence the verifier takes again): its next round sends the next
        chunk of them alone (`verify_input`), with no tree and no Draft, and nothing of what
        the verifier draws past them is kept. Not where the request asks for its prompt's
        log-probabilities (its first round reads every prompt row)."""
        return (
            self.prefill_chunk > 0
            and len(self.tokens) - self.verifier_kv_committed_len > self.prefill_chunk
            and self._prompt_ask() == NO_LOGPROBS
        )

    @property
    def starts(self) -> bool:
        """Whether its next round ends its prefill (the whole prompt, or the last of its
        chunks): the round that draws its first token."""
        return not self.prefilling and (not self.verifier_begun or self.chunked)

    @property
    def never_drafts(self) -> bool:
        """Speculation off for the request's whole life: its shape has no draft steps and no
        adaptive ladder moves it, and it is not a session's turn (a later turn may draft from
        this one's hidden states). It never calls the drafter and asks the verifier for no
        hidden states."""
        return (
            self.spec.num_steps == 0 and self.adaptive is None and self.request.session_id is None
        )

    def round_spec(self, committing: int = 0) -> SpecParams:
        """The tree shape this round: never deeper than the tokens still allowed (accepted
        drafts + bonus must fit max_new_tokens); no drafts while the speculation gate holds
        them back (`drafts_held`). committing: tokens the round being verified will commit
        first (the next round's shape, as far as it is known before: a hint's)."""
        left = 0 if self.drafts_held else self.request.max_new_tokens - self.num_generated_tokens
        spec = self.spec if self.adaptive is None else self.adaptive.spec
        return spec.capped(left - committing - 1)

    def keep_ahead(self, trees: list[AheadTree], base: int, rounds: int) -> None:
        """Draft-ahead's trees for the round verified from the sequence's first `base` tokens
        after `rounds` rounds (its state before that round's commit, which may come first)."""
        self.ahead = {tuple(a.tokens): a.tree for a in trees}
        self.ahead_round = rounds
        self.ahead_base = base

    def take_ahead(self) -> DraftTree | None:
        """The tree drafted ahead for the outcome the last round had (None: not guessed, or
        nothing drafted ahead for that round), cut to this round's shape."""
        guessed, self.ahead = self.ahead, {}
        if not guessed or self.ahead_round != self.stats.rounds - 1:
            return None
        tree = guessed.get(tuple(self.tokens[self.ahead_base :]))
        return None if tree is None else self.fit(tree)

    def fit(self, tree: DraftTree, committing: int = 0) -> DraftTree:
        """`tree` cut to this sequence's round shape (`round_spec`; after `committing` tokens:
        the next round's, as a hint to the verifier names it)."""
        spec = self.round_spec(committing)
        return tree.fitted(spec.num_steps, spec.num_draft_tokens)

    def draft_input(self) -> DraftInput:
        # at least the root goes out again: after a failed verify nothing new was committed
        start = min(self.drafter_num_tokens, len(self.tokens) - 1)
        item = DraftInput(
            seq_id=self.seq_id,
            begin=not self.drafter_begun,
            start=start,
            new_tokens=self.tokens[start:],
            spec=self.round_spec(),
            sampling=self.request.sampling,
            target_kv_committed_len=self.verifier_kv_committed_len,
        )
        if not self.drafter_rules_sent:
            self.drafter_rules_sent = True
            item.rules = self.draft_rules(item.begin)
        guide = self.request.guide
        if guide is not None and item.spec.num_steps:  # (the first drafts keep to the guide)
            words = guide.mask(self.guide_state)
            item.root_allowed = b"" if words is None else words.tobytes()
        self.drafter_begun = True
        self.drafter_num_tokens = len(self.tokens)
        if self.hidden_state_layers:
            if start < self.features.start:  # not held: the verifier gives them again
                self.lose_features()
            # the drafter holds tokens[:start] and their rows (a Draft that fails starts it
            # over: forget_drafter), so the rows before start go
            self.features.drop_before(start)
            # rows for tokens[start : features.end]; next time start where the rows end, so
            # that the drafter gets the row of every token exactly once
            item.target_hidden_states = self.features.rows_from(start)
            self.drafter_num_tokens = min(len(self.tokens), self.features.end)
        return item

    def draft_rules(self, begin: bool) -> DraftRules | None:
        """The logit rules the drafter is to bend this sequence's drafts by (its request's bias
        and penalties): sent with its first Draft of the turn, where there are any or the drafter
        holds the sequence already (a session's earlier turn may have left others)."""
        penalties = self.request.penalties
        if penalties is None and begin:
            return None
        return DraftRules(penalties or Penalties(), self.num_prompt_tokens)

    @property
    def num_feature_rows(self) -> int:
        """Leading tokens whose target features the gateway has had (all it committed, unless
        the speculation gate's plain rounds left a gap or the drafter lost its rows)."""
        return self.features.end

    def lose_features(self) -> None:
        """The rows the drafter needs next are not held (it lost the sequence after the gateway
        let them go): the verifier verifies every token again, with its features, before
        speculation resumes (the scheduler's `_restart_features`, as after a gap)."""
        self.features = FeatureRows()
        self.features_gap = True

    def adopt_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """The drafter reads these target layers (learned from its answer, before the prefill):
        its tokens are sent again from where the features will start."""
        if layers != self.hidden_state_layers:
            self.hidden_state_layers = layers
            if layers:
                self.drafter_num_tokens = min(
                    self.drafter_num_tokens, self.verifier_kv_committed_len
                )

    def forget_drafter(self) -> None:
        """The drafter lost (or may have lost) this sequence: start over on the next Draft. Its
        target features start over too when the gateway no longer holds them from token 0."""
        self.drafter_begun = False
        self.drafter_num_tokens = 0
        self.drafter_rules_sent = False
        if self.hidden_state_layers and self.features.start > 0:
            self.lose_features()

    def keep_verifier_kv(self, length: int) -> None:
        """The verifier now holds the KV of tokens[:length] only (truncated): the EAGLE rows
        past it go too."""
        assert 0 <= length <= self.verifier_kv_committed_len, (self.seq_id, length)
        self.verifier_kv_committed_len = length
        self.rules_kept = False  # (the verifier's truncate drops them)
        self.features.keep(length)

    def forget_verifier(self) -> None:
        """The verifier lost this sequence: re-prefill all tokens on the next Verify."""
        self.verifier_begun = False
        self.verifier_kv_committed_len = 0
        self.rules_kept = False  # (sent again with the re-prefill)
        self.features = FeatureRows()
        self.features_gap = False  # the re-prefill brings every token's features
        self.rounds_since_prefill = 0
        if self.hidden_state_layers:  # the drafter's features restart with the re-prefill
            self.drafter_num_tokens = 0

    def verify_input(self, tree: DraftTree, decode_steps: int = 1, lookup: int = 0) -> VerifyInput:
        """This round's Verify. decode_steps: how many steps a plain round (no tree, no
        features, not the prefill) decodes, at most the tokens still allowed; lookup: the
        chains of prompt lookup its steps verify (VerifyInput.lookup), unless the request asked
        for no drafts; the stop rules cut what comes past a stop when the round commits."""
        # held back, the round asks for no features: plain rounds cost what the target
        # alone does (scheduler._restart_features has them verified again on resuming)
        layers = () if self.drafts_held else self.hidden_state_layers
        if self.prefilling:
            return self._chunk_input(layers)
        steps, chains = 1, 0
        guide = self.request.guide
        # (a guide's masks are made here, a round at a time)
        if not tree and not layers and self.verifier_begun and guide is None:
            left = self.request.max_new_tokens - self.num_generated_tokens
            steps = max(1, min(decode_steps, left))
            # (not cut to what is left: a seeded sampler's draws follow the chains, which then
            # depend on the tokens alone, not on where rounds begin); none for a request that
            # asked for no drafts (its own spec of 0 steps: the target alone)
            own = self.request.spec
            chains = 0 if own is not None and own.num_steps == 0 else lookup
        allowed = None if guide is None else round_allowed(guide, self.guide_state, tree)
        kept = self.rules_kept and self.verifier_begun
        rules = round_rules(self.rules_context, allowed, kept)
        self.rules_sent = rules is not None
        return VerifyInput(
            seq_id=self.seq_id,
            begin=not self.verifier_begun,
            kv_committed_len=self.verifier_kv_committed_len,
            pending_tokens=self.tokens[self.verifier_kv_committed_len :],
            tree=tree,
            sampling=self.request.sampling,
            hidden_state_layers=layers,
            decode_steps=steps,
            lookup=chains,
            logprobs=NO_LOGPROBS if self.request.logprobs is None else self.request.logprobs,
            prompt_logprobs=self._prompt_ask(),
            rules=rules,
        )

    def _chunk_input(self, layers: tuple[int, ...]) -> VerifyInput:
        """A chunk round's Verify (`prefilling`): the next prefill_chunk tokens the verifier
        lacks, no tree, greedy (a seeded sampler draws nothing for it, so its draws follow
        the tokens alone), no log-probabilities or rules (none reads its drawn token)."""
        start = self.verifier_kv_committed_len
        self.rules_sent = False
        return VerifyInput(
            seq_id=self.seq_id,
            begin=not self.verifier_begun,
            kv_committed_len=start,
            pending_tokens=self.tokens[start : start + self.prefill_chunk],
            tree=DraftTree(),
            hidden_state_layers=layers,
        )

    def _prompt_ask(self) -> int:
        """The prompt's log-probabilities asked of the first round (a re-prefill's too, until
        they came: `prompt_logprobs`)."""
        asked = self.request.prompt_logprobs
        if asked is None or self.verifier_begun or self.prompt_logprobs is not None:
            return NO_LOGPROBS
        return asked

    def adapt(self, tree: DraftTree, out: VerifyOutput) -> None:
        """Adaptive speculation: this round's acceptance of `tree` may move the draft shape."""
        if self.adaptive is not None:
            self.adaptive.observe(out.num_accepted_drafts, max(tree.depths(), default=0))

    def _take_features(self, out: VerifyOutput) -> None:
        """The round's target features (EAGLE drafters), rows of the tokens it committed."""
        if self.hidden_state_layers and (out.hidden_states is None or self.features_gap):
            self.features_gap = True  # a round held back by the gate: no features asked
        elif self.hidden_state_layers:
            # the verifier's rows cover tokens[old kv_committed_len : new kv_committed_len]
            assert out.hidden_states is not None, self.seq_id
            num_rows = self.num_feature_rows
            assert num_rows == self.verifier_kv_committed_len, (self.seq_id, num_rows)
            self.features.append(out.hidden_states)
            assert (
                out.hidden_states.shape[0] == out.kv_committed_len - self.verifier_kv_committed_len
            )

    def commit_chunk(self, out: VerifyOutput) -> None:
        """A chunk round committed (`prefilling`): the verifier holds its tokens' KV (and gave
        their features); the token it drew past them is not this sequence's (the next tokens
        are the prompt's own) and is dropped, and the verifier keeps no rules from it."""
        start = self.verifier_kv_committed_len
        assert out.kv_committed_len == start + self.prefill_chunk, (self.seq_id, start)
        self._take_features(out)
        self.verifier_begun = True
        self.verifier_kv_committed_len = out.kv_committed_len
        self.rules_kept = False
        self.chunked = True

    def commit(self, out: VerifyOutput) -> Committed:
        """Append accepted drafts + bonus and apply the stop rules: everything the next round
        needs. The text and the chunk to stream follow in `chunk` (the scheduler makes them
        after the next round's first RPC is on its way); with stop strings the text is made
        here, since the rules read it."""
        self._take_features(out)
        self.verifier_begun = True
        self.chunked = False
        self.verifier_kv_committed_len = out.kv_committed_len
        self.rounds_since_prefill += 1
        # a round's further decode steps count as rounds of their own, prompt lookup's accepted
        # drafts in them as accepted drafts
        looked_up = out.num_lookup_accepted
        self.stats.rounds += 1 + len(out.decoded_tokens) - looked_up
        self.stats.num_accepted_drafts += out.num_accepted_drafts + looked_up
        self.stats.num_accepted_tokens += out.num_accepted_tokens + len(out.decoded_tokens)
        new = out.new_tokens
        text: str | None = None  # made here only when the rules read it
        if self.stop_checker.reads_text:
            outcome = self.stop_checker.commit(new)
            num_kept, finish, text = outcome.num_kept_tokens, outcome.finish_reason, outcome.text
            num_text = 0  # its text is made
        else:
            rules = self.stop_checker.commit_tokens(new)
            num_kept, finish, num_text = (
                rules.num_kept_tokens,
                rules.finish_reason,
                rules.num_text_tokens,
            )
        kept = new[:num_kept]
        prompt = None  # the prompt's log-probabilities, with the first round that has them
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            prompt = self.prompt_logprobs = out.prompt_logprobs.cut(self.num_prompt_tokens - 1)
        logprobs = None
        if self.request.logprobs is not None:
            assert out.logprobs is not None and len(out.logprobs) == len(new), self.seq_id
            logprobs = out.logprobs.cut(num_kept)
        self.tokens += kept
        if self.rules_context is not None:
            self.rules_context = self.rules_context.after(kept)
        # the verifier's kept rules read what it committed: all of it, or the context again
        self.rules_kept = self.rules_sent and num_kept == len(new)
        if self.request.guide is not None:
            self.guide_state = self.request.guide.walk(self.guide_state, kept)
            assert self.guide_state != DEAD, (self.seq_id, kept)  # the masks allowed each
        if finish is not None:
            self.finished = True
            self.finish_reason = str(finish)
        else:
            # DESIGN.md §2: the verifier's KV covers every token but the last bonus
            assert self.verifier_kv_committed_len == len(self.tokens) - 1, (
                self.seq_id,
                self.verifier_kv_committed_len,
                len(self.tokens),
            )
        return Committed(out, kept, kept[:num_text], finish is not None, text, logprobs, prompt)

    def chunk(self, committed: Committed) -> Chunk:
        """What to stream of a committed round: its text (detokenized now unless the stop rules
        did it in `commit`), and on the last round the finish and the totals. Rounds in order."""
        text = committed.text
        if text is None:
            text = self.stop_checker.text_of(committed.text_ids, committed.finished)
        if self.turn is not None:  # a chat session keeps the reply as the client saw it
            self.turn.reply_parts.append(text)
        chunk = Chunk(
            token_ids=committed.token_ids,
            text=text,
            elapsed_ns=time.monotonic_ns() - self.arrival_ns,
            logprobs=committed.logprobs,
            prompt_logprobs=committed.prompt_logprobs,
        )
        if committed.finished:
            chunk.finish_reason = self.finish_reason
            chunk.prompt_tokens = self.num_prompt_tokens
            chunk.completion_tokens = self.num_generated_tokens
            chunk.stats = self.stats
        return chunk


@dataclass
class Committed:
    """A round appended to its sequence (Sequence.commit) whose chunk is not made yet."""

    out: VerifyOutput
    token_ids: list[int]  # the tokens kept
    text_ids: list[int]  # of them, those whose text is streamed (all but an EOS / stop token)
    finished: bool  # the sequence's last round
    text: str | None  # made already when the stop rules read the text (stop strings)
    logprobs: TokenLogprobs | None = None  # the kept tokens' (where the request asks)
    prompt_logprobs: TokenLogprobs | None = None  # the first round's, where the request asks
