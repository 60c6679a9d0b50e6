"""The verifier's decode steps run before they are asked for (`RunAhead`, a mixin of
VerifierEngine that declares what it uses of it): the next decode step after a round of decode
steps (`_launch_ahead`) and after a round's last step the steps behind it that the trip between
rounds needs (`_extend_ahead`, verifier/ahead_depth.py); and how the next round takes a round run
ahead (`_take_ahead`: such a step, or a round run on the gateway's hint, verifier/hinted_rounds.py),
or drops it and gives back its room and draws (`_drop_ahead`, `_undo_ahead`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch

from specsplit.errors import ServiceError
from specsplit.messages import NO_LOGPROBS, VerifyInput
from specsplit.model.transfer import on_device
from verifier.device_rounds import DeviceRounds
from verifier.round_accept import to_host
from verifier.rounds import (
    UNKNOWN_TOKEN,
    Launched,
    VerifierSeq,
    VerifyRound,
    committed_as,
    decode_step,
    is_step,
)

log = logging.getLogger(__name__)

# why a decode step run ahead was dropped (`RunAhead.num_ahead_dropped_by`, /metrics'
# specsplit_decode_ahead_dropped_total): the next round took none of it; its sequences were
# released or truncated; it was queued behind a step a newcomer joined (`_join_ahead`, depth 3);
# the next round was hinted or launched beside another in flight; a round failed
DROP_REASONS = ("unasked", "released", "truncated", "joined", "other work", "failed")


class RunAhead(DeviceRounds):
    # the engine's, which these rounds use (with DeviceRounds')
    seqs: dict[str, VerifierSeq]
    max_context: int
    decode_ahead_max_batch: int
    num_ahead_used: int
    num_ahead_dropped_by: Counter[str]  # decode steps run ahead and dropped, by DROP_REASONS
    num_next_used: int
    num_next_dropped: int
    on_decode_ahead: Callable[[str], None] | None
    on_decode_ahead_dropped: Callable[[str], None] | None  # each dropped step's reason
    on_round_ahead: Callable[[str], None] | None
    _ahead: Launched | None
    _in_flight: list[VerifyRound]
    _reserve: Callable[[list[VerifyInput], list[VerifierSeq]], None]

    @property
    def num_ahead_dropped(self) -> int:
        """Decode steps run ahead that the next round was not (every reason)."""
        return sum(self.num_ahead_dropped_by.values())

    def _launch_ahead(
        self, parts: list[Launched], bonus: list[torch.Tensor], capped: bool = True
    ) -> Launched | None:
        """After a round of decode steps (every sequence: no tree, no hidden states; launched
        as `parts`, one or two, whose bonus tokens on the device are `bonus`), the same
        sequences' next decode step, launched before the round is waited for: the round the
        gateway sends next when it goes on decoding them all (each bonus token its one pending
        token, the same sampling). A decode round's commit is known before its tokens are (its
        pending tokens, no drafts): the step is built on the KV lengths that commit makes, and
        each bonus token goes to it device to device (`_finish_round` writes them into its inputs
        once known). On a GPU it runs back to back with the round while the host commits,
        answers and the gateway works; `_take_ahead` keeps it only for the next round's items
        that are exactly that step, so it changes no output (a sampled step draws from each
        sequence's generator, whose state `_undo_ahead` puts back where it is not taken).
        None when this round does not qualify or the next step would not fit (context, free
        pages). `capped`: none for more than decode_ahead_max_batch sequences (the next round
        is the gateway's, which may be another; not when it is the round's own further step,
        which always takes it)."""
        done_inputs = [item for part in parts for item in part.inputs]
        done_seqs = [seq for part in parts for seq in part.seqs]
        if capped and len(done_inputs) > self.decode_ahead_max_batch:
            return None
        if not _plain(done_inputs):
            return None
        # as the round's commit leaves them (the round's items' lengths: a step run ahead's
        # are past its sequences' committed lengths until the rounds before it commit)
        committed = [item.kv_committed_len + len(item.pending_tokens) for item in done_inputs]
        if any(length + 1 > self.max_context for length in committed):
            return None
        # each with the round's rules: the step's bending counts its token on the device
        # (`bend_by_rules`' pending), `_finish_round` adds it to them once it is known
        inputs = [
            decode_step(
                item.seq_id,
                length,
                UNKNOWN_TOKEN,
                item.sampling,
                logprobs=item.logprobs,
                rules=item.rules,
            )
            for item, length in zip(done_inputs, committed, strict=True)
        ]
        tokens = bonus[0] if len(bonus) == 1 else torch.cat(bonus)
        states = [None if seq.generator is None else seq.generator.get_state() for seq in done_seqs]
        with committed_as(done_seqs, committed):  # as the round's commit leaves them
            try:
                self._reserve(inputs, done_seqs)
            except ServiceError:  # no free pages for it: nothing runs ahead
                return None
            try:
                launched = self._launch(inputs, done_seqs, tokens)
            except Exception:  # the round itself goes on: its answer must still go out
                log.exception("a decode step run ahead failed to launch")
                self._undo_ahead(Launched(inputs, done_seqs, torch.empty(0), None, states))
                return None
        launched.generator_states = states
        return launched

    def extend_ahead(self) -> bool:
        """Once a round's answer went out (the service's `PipelinedRounds`): queue one more
        decode step behind the one run ahead if fewer than `ahead_depth` are
        (`_extend_ahead`), while the answer travels and the gateway works. One a call, so that
        a request arriving meanwhile waits for one launch at most (the caller calls again on
        its event loop's next turn). Whether another is wanted. Nothing to do at depth 1."""
        ahead = self._ahead
        if ahead is None or ahead.hinted or self._in_flight or not self.ahead_depth.queues:
            return False
        with torch.inference_mode(), on_device(self.device):
            return self._extend_ahead(ahead, self.ahead_depth.depth(len(ahead.inputs)))

    def top_up(self, launched: VerifyRound) -> None:
        """While the device still runs `launched` (its results not yet copied: the host would
        only wait for them), queue decode steps behind the one launched ahead of it
        (`launched.ahead`) until `ahead_depth` are: the host's idle time, not the trip after
        the answer, pays for their launches, and a request never waits behind them. Called by
        the service before it waits for a round's first step and by `_decode_further` before
        each further step's wait; the steps still missing once the answer went out follow then
        (`extend_ahead`). Nothing at depth 1, nor off a GPU (a round there is
        done when launched)."""
        ahead = launched.ahead
        if ahead is None or ahead.hinted or not self.ahead_depth.queues:
            return
        depth = self.ahead_depth.depth(len(ahead.inputs))
        with torch.inference_mode(), on_device(self.device):
            while not launched.ready() and self._extend_ahead(ahead, depth):
                pass

    def _extend_ahead(self, ahead: Launched, depth: int) -> bool:
        """One decode step behind the last of `ahead` (the next round's first, run ahead) and
        those queued behind it if fewer than `depth` are, launched on the one before's bonus
        tokens on the device (`Launched.follower`): the next round takes them in turn, as its
        first step and its own further steps (or, a round of one step, as the step after it).
        The one before keeps its results in a copy of its own (the steps replay one CUDA graph,
        whose output each overwrites): a round that takes it but not the steps behind reads
        them there. Whether more are wanted."""
        last, queued = ahead, 1
        while last.follower is not None:
            last, queued = last.follower, queued + 1
        if queued >= depth:
            return False
        if any(item.rules is not None for item in last.inputs):
            return (
                False  # (one step runs ahead under rules: the next would read two unknown tokens)
            )
        last.packed = last.packed.clone()
        follower = self._launch_ahead([last], [self._bonus_tokens(last)])
        last.follower = follower
        return follower is not None and queued + 1 < depth

    def _join_ahead(self, queued: Launched, new: Launched, capped: bool = True) -> Launched:
        """The next step of a round that took a step run ahead and launched `new` beside it (a
        newcomer's prefill, most often), when a step was `queued` behind the one taken: that
        step, and `new`'s sequences' next step launched now on its bonus tokens, as one step
        run ahead (`_joined`: the next round takes it whole, the steps queued behind it cover
        both). Until the sixtieth session the queued step was dropped and one for all launched
        in its place: at depth 2 a step of device time thrown away a newcomer. The steps queued
        behind `queued` (depth 3) are dropped first: they are its sequences' alone, and the
        newcomers' step may take the pages they give back. `queued` alone when `new`'s next
        step cannot run ahead (a tree, hidden states, no room, past decode_ahead_max_batch
        together, unless not `capped`: `_launch_ahead`): the next round takes it and launches
        those sequences beside it again."""
        if capped and len(queued.inputs) + len(new.inputs) > self.decode_ahead_max_batch:
            return queued
        if not _plain(new.inputs) or _asks_logprobs(queued.inputs + new.inputs):
            return queued  # (`_joined` gathers results, not log-probabilities)
        if queued.follower is not None:
            behind, queued.follower = queued.follower, None
            self._drop(behind, "joined", room=2)  # (the steps that go on keep their room)
        beside = self._launch_ahead([new], [self._bonus_tokens(new)], capped=False)
        return queued if beside is None else _joined(queued, beside, self.device)

    def _bonus_tokens(self, done: Launched) -> torch.Tensor:
        """`done`'s bonus tokens on the device, its inputs' order: a view of its results, or
        for a step taken in part its rows (the index crosses without a wait)."""
        return done.own_results(self.device)[:, 1]

    def _take_ahead(self, inputs: list[VerifyInput]) -> tuple[Launched | None, list[int]]:
        """The decode step launched ahead, for the items of `inputs` (validated) that are that
        step for their sequence: its bonus token and nothing else, the same sampling, no hidden
        states. Returns it (cut to those sequences, in the round's order, with the steps queued
        behind it: `Launched.part`) and their positions in `inputs`; the round's other items (a
        sequence joining the batch, most often) are launched beside it. Sequences of the step
        the round does not take it for (finished and released, or sent another round) get their
        room and draws back, the queued steps' too. A round that takes none of it drops it:
        (None, []). Until the fifty-ninth session a round that took the step for some of its
        sequences dropped the steps queued behind it: at depth 2 a step of device time thrown
        away whenever a sequence finished."""
        ahead = self._ahead
        if ahead is None:
            return None, []
        index = {item.seq_id: j for j, item in enumerate(ahead.inputs)}
        positions: list[int] = []
        keep: list[int] = []
        for i, item in enumerate(inputs):
            j = index.get(item.seq_id)
            if j is not None and is_step(item, ahead.inputs[j]):
                positions.append(i)
                keep.append(j)
        if not keep:
            self._drop_ahead("unasked")
            return None, []
        self._ahead = None
        self._count_ahead(ahead, "used")
        if keep == list(range(len(ahead.inputs))):  # (most rounds take the whole step)
            return ahead, positions
        taken = ahead.part(keep)  # (the queued steps cut alike: their sequences, the round's order)
        if len(keep) < len(ahead.inputs):
            # the others' room past their committed length (the queued steps' too) and the
            # draws of the step, the first that drew
            ahead.follower = None
            self._undo_ahead(ahead, kept=set(keep))
        return taken, positions

    def _drop_ahead(self, reason: str) -> None:
        """Forget the decode step run ahead (for `reason`, one of DROP_REASONS): give each of
        its sequences its room and draws back (`_drop`)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._drop(ahead, reason)

    def _drop(self, step: Launched, reason: str, room: int = 0) -> None:
        """Count `step` dropped for `reason`, then undo it and the steps behind it
        (`_undo_ahead`, down to the committed length + `room`) without waiting for the device:
        it still runs them, and whatever the host launches next runs after them (one stream),
        so their K/V writes land before any later write to the pages given back, and every host
        buffer their launches filled (the graphs' mirrors, `to_device`'s staging) is reused
        only once its copy has run (its event). Until the fifty-eighth session the host waited
        here for the device: a newcomer whose round dropped queued steps waited for them before
        its own launch."""
        self._count_ahead(step, "dropped", reason)
        self._undo_ahead(step, room=room, reason=reason)

    def _count_ahead(self, ahead: Launched, outcome: str, reason: str = "") -> None:
        """A round run ahead was taken ("used") or not ("dropped", for `reason`: a decode
        step's, one of DROP_REASONS): a decode step's counts, or a hinted round's
        (`_launch_next`)."""
        if ahead.hinted:
            self.num_next_used += outcome == "used"
            self.num_next_dropped += outcome == "dropped"
            report = self.on_round_ahead
        else:
            self.num_ahead_used += outcome == "used"
            if outcome == "dropped":
                self.num_ahead_dropped_by[reason] += 1
                if self.on_decode_ahead_dropped is not None:
                    self.on_decode_ahead_dropped(reason)
                if self.ahead_depth.auto:
                    self.ahead_depth.observe_drop()
            report = self.on_decode_ahead
        if report is not None:
            report(outcome)

    def _undo_ahead(
        self, ahead: Launched, kept: set[int] | None = None, room: int = 0, reason: str = "failed"
    ) -> None:
        """Each live sequence's share of a step run ahead not taken (all but the indices
        `kept`), and of the steps queued behind it (`Launched.follower`, undone first, the last
        launched first, counted dropped for `reason`: a failed round's unless a drop's): free
        the room they reserved past the committed length + `room` and put back the generator
        state the step drew from. Their K/V writes sit past the
        sequence's committed length, where its next round writes again (stream-ordered on a
        GPU, also into pages freed meanwhile: later steps write after them). A released
        sequence has nothing left to undo."""
        if ahead.follower is not None:
            follower, ahead.follower = ahead.follower, None
            self._count_ahead(follower, "dropped", reason)
            self._undo_ahead(follower, room=room, reason=reason)
        states = ahead.generator_states or [None] * len(ahead.seqs)
        for k, (seq, state) in enumerate(zip(ahead.seqs, states, strict=True)):
            if (kept is not None and k in kept) or self.seqs.get(seq.seq_id) is not seq:
                continue
            self.kv.trim(seq.kv, seq.kv.kv_committed_len + room)
            if state is None:
                seq.generator = None  # the step made it: the next sampled round makes its own
            elif seq.generator is not None:
                seq.generator.set_state(state)


def _plain(items: list[VerifyInput]) -> bool:
    """Whether a round of `items` may have its next decode step run ahead: no tree, no hidden
    states, no guide (its masks for the next step are the gateway's; other logit rules read the
    token this one draws on the device)."""
    return not any(
        item.tree or item.hidden_state_layers or (item.rules and not item.rules.carried)
        for item in items
    )


def _asks_logprobs(items: list[VerifyInput]) -> bool:
    return any(item.logprobs != NO_LOGPROBS for item in items)


def _joined(first: Launched, beside: Launched, device: torch.device) -> Launched:
    """Two decode steps run ahead, the second launched beside the first for other sequences,
    as one: their inputs, sequences and draws in turn, their results (a decode step's two
    columns: no drafts accepted, the bonus token) gathered into one tensor queued on the device
    after both, with its own copy to the host. Its device time is not counted (no `started`:
    a step's time is measured on steps launched whole)."""
    first_rows = first.own_results(device)[:, :2]
    beside_rows = beside.own_results(device)[:, :2].to(first_rows.dtype)
    packed = torch.cat([first_rows, beside_rows])
    states = [
        *(first.generator_states or [None] * len(first.seqs)),
        *(beside.generator_states or [None] * len(beside.seqs)),
    ]
    inputs, seqs = [*first.inputs, *beside.inputs], [*first.seqs, *beside.seqs]
    if packed.device.type != "cuda":
        return Launched(inputs, seqs, packed, None, states)
    host = to_host(packed)
    copied = torch.cuda.Event(enable_timing=True)
    copied.record(torch.cuda.current_stream(device))
    return Launched(inputs, seqs, packed, None, states, host=host, copied=copied)
