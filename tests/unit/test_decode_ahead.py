"""The verifier's decode steps run ahead (`VerifierEngine(decode_ahead=True)`): the next decode
step is launched before it is asked for and kept only when the next round is exactly that step;
after a round's last step, `depth` steps, each behind the one before (verifier/ahead_depth.py;
every case runs at depths 1 to 3). Whatever the gateway sends next (that step, a tree, another
batch, a release, a truncation, a sampled round), the tokens and the committed KV are those of an
engine without it, and no page stays held."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch

from specsplit.errors import Code, ServiceError
from specsplit.messages import SpecParams, Truncation, VerifyInput, VerifyOutput
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.support import (
    generate_all,
    generated_ids,
    make_stack,
    mixed_requests,
    save_tiny_llama,
    target_only_ids,
)
from verifier.ahead_depth import MAX_DEPTH, AheadDepth
from verifier.engine import VerifierEngine
from verifier.pipelined import PipelinedRounds
from verifier.rounds import Launched, VerifyRound

PROMPTS = {"a": [5, 17, 99, 3, 250, 41, 8], "b": [7, 7, 300, 12]}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("ahead") / "target", seed=23)


@pytest.fixture(scope="module")
def device() -> str:
    """The engines' device (tests/gpu/test_decode_ahead_gpu.py runs these tests on CUDA)."""
    return "cpu"


@pytest.fixture(params=range(1, MAX_DEPTH + 1), ids=lambda d: f"depth{d}")
def depth(request: pytest.FixtureRequest) -> int:
    """Decode steps run ahead after a round's last step (`--decode-ahead-depth`)."""
    return int(request.param)


def _engine(
    target_dir: Path,
    decode_ahead: bool,
    device: str = "cpu",
    num_pages: int = 64,
    dtype: torch.dtype | None = None,
    page_size: int = 4,
    depth: int = 1,
) -> VerifierEngine:
    """float64 on the CPU; on a GPU float32 (or `dtype`) with the decode and 1 + 3 graphs, as
    served; `depth` steps run ahead after a round's last step."""
    dtype = dtype or (torch.float64 if device == "cpu" else torch.float32)
    model, config = load_model(str(target_dir), dtype=dtype, device=device)
    kv = make_kv_cache(config, num_pages, page_size, dtype, device)
    graphs = (1, 4) if device != "cpu" else ()
    engine = VerifierEngine(
        model,
        kv,
        config.max_position_embeddings,
        config.vocab_size,
        graph_query_lens=graphs,
        max_batch_size=4,
        decode_ahead=decode_ahead,
    )
    engine.ahead_depth = AheadDepth(depth)
    if graphs:
        engine.warmup()
    return engine


class Driver:
    """Sends rounds as the gateway does: each sequence's bonus token is its next pending token."""

    def __init__(self, engine: VerifierEngine, layers: tuple[int, ...] = ()) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.committed: dict[str, int] = {}
        self.layers = layers  # every round's hidden-state layers (the EAGLE drafter's ask)
        self.unhinted = False  # every round's items marked so (a draft-ahead round, no hint)
        self.hidden: dict[str, list[torch.Tensor]] = {}  # each round's rows, with `layers`

    def begin(self, *seq_ids: str) -> None:
        self.round({s: DraftTree() for s in seq_ids}, begin=True)

    def round(
        self,
        trees: dict[str, DraftTree],
        begin: bool | set[str] = False,
        sampling: SamplingParams | None = None,
        steps: dict[str, int] | None = None,
        meanwhile: Callable[[], None] | None = None,
        lookup: dict[str, int] | None = None,
    ) -> list[VerifyOutput]:
        """One round; `begin`: every sequence's first (True) or these sequences'; `steps`:
        sequences' decode_steps (1 for the others), `lookup` their VerifyInput.lookup (0 for
        the others); `meanwhile`: called between the round's
        launch and its finish (the gateway's hint for it comes then)."""
        begins = set(trees) if begin is True else set(begin or ())
        inputs = []
        for seq_id, tree in trees.items():
            if seq_id in begins:
                self.tokens[seq_id], self.committed[seq_id] = list(PROMPTS[seq_id]), 0
            committed = self.committed[seq_id]
            pending = self.tokens[seq_id][committed:]
            item = VerifyInput(seq_id, seq_id in begins, committed, pending, tree)
            item.hidden_state_layers = self.layers
            item.decode_steps = (steps or {}).get(seq_id, 1)
            item.lookup = (lookup or {}).get(seq_id, 0)
            item.unhinted = self.unhinted
            if sampling is not None:
                item.sampling = sampling
            inputs.append(item)
        if meanwhile is None:
            outputs = self.engine.verify(inputs)
        else:
            launched = self.engine.launch(inputs)
            meanwhile()
            outputs = self.engine.finish(launched)
        while self.engine.extend_ahead():  # as the service does once the answer went out
            pass
        for out in outputs:
            tokens = self.tokens[out.seq_id]
            del tokens[out.kv_committed_len :]
            tokens += out.new_tokens
            self.committed[out.seq_id] = out.kv_committed_len
            if out.hidden_states is not None:
                self.hidden.setdefault(out.seq_id, []).append(out.hidden_states.float())
        self.engine.check_integrity()
        return outputs

    def decode(self, *seq_ids: str, rounds: int) -> None:
        for _ in range(rounds):
            self.round({s: DraftTree() for s in seq_ids})

    def kv_rows(self, seq_id: str) -> torch.Tensor:
        kv = self.engine.kv
        slots = self.engine.seqs[seq_id].kv.slots(0, self.committed[seq_id])
        return torch.stack(
            [torch.stack([k[slots], v[slots]]) for k, v in zip(kv.k, kv.v, strict=True)]
        )


def _both(target_dir: Path, device: str, depth: int = 1) -> tuple[Driver, Driver]:
    plain = Driver(_engine(target_dir, False, device))
    return plain, Driver(_engine(target_dir, True, device, depth=depth))


def _same(plain: Driver, ahead: Driver, max_extra_pages: int | None = None) -> None:
    """The same tokens, lengths and committed K/V; `ahead` holds at most `max_extra_pages`
    more pages (default: one a sequence, a decode step's)."""
    assert ahead.tokens == plain.tokens
    assert ahead.committed == plain.committed
    for seq_id in plain.engine.seqs:
        # bit for bit, but for a step taken for fewer sequences than it was run for: computed
        # in a larger batch, its matmuls may round differently (as any step's across batches)
        torch.testing.assert_close(ahead.kv_rows(seq_id), plain.kv_rows(seq_id), rtol=0, atol=1e-5)
    # the steps run ahead (at most MAX_DEPTH, fewer than a page's slots) hold at most a page
    # per sequence more
    extra = ahead.engine.num_pages_used - plain.engine.num_pages_used
    assert 0 <= extra <= (len(plain.engine.seqs) if max_extra_pages is None else max_extra_pages)


def _release(*drivers: Driver) -> None:
    for driver in drivers:  # and once released, no page held
        driver.engine.release(list(driver.engine.seqs))
        assert driver.engine.num_pages_used == 0


# each sequence's greedy tokens (its prompt, then decoded by a plain engine), by (target,
# device, sequence), decoded once and again longer only when a test reads past them: an engine
# made per chain cost the GPU tests a warm-up (its graphs captured) each, ~20 s a test
_GREEDY: dict[tuple[str, str, str], list[int]] = {}
_GREEDY_MARGIN = 32  # tokens decoded past the most asked for, for the next asks


def _greedy(target_dir: Path, device: str, seq_id: str, length: int) -> list[int]:
    """The first `length` greedy tokens of `seq_id` (prompt included) on the target."""
    key = (str(target_dir), device, seq_id)
    tokens = _GREEDY.get(key, [])
    if len(tokens) < length:
        reference = Driver(_engine(target_dir, False, device))
        reference.begin(seq_id)  # the prompt and one token
        rounds = max(0, length - len(PROMPTS[seq_id]) - 1) + _GREEDY_MARGIN
        reference.decode(seq_id, rounds=rounds)
        tokens = _GREEDY[key] = reference.tokens[seq_id]
        reference.engine.release([seq_id])
    return tokens[:length]


def _chain(target_dir: Path, device: str, driver: Driver, seq_id: str, right: int) -> DraftTree:
    """A chain of the target's next `right` tokens after `driver`'s (`_greedy`), then a wrong
    one."""
    have = len(driver.tokens[seq_id])
    future = _greedy(target_dir, device, seq_id, have + right)[have:]
    assert len(future) == right, (have, right)
    return DraftTree([*future, (future[-1] + 1) % 256], list(range(-1, right)))


def test_decode_rounds_take_the_step_run_ahead_and_give_the_same_tokens(
    target_dir: Path, device: str, depth: int
) -> None:
    plain, ahead = _both(target_dir, device, depth)
    for driver in (plain, ahead):
        driver.begin("a", "b")
        driver.decode("a", "b", rounds=12)
    _same(plain, ahead)
    assert ahead.engine.num_ahead_used >= 11
    assert ahead.engine.num_ahead_dropped == 0
    assert plain.engine.num_ahead_used == 0
    _release(plain, ahead)


class _Recorded(AheadDepth):
    """Auto's depth, each measurement it is given kept."""

    def __init__(self) -> None:
        super().__init__(0)
        self.trips: list[tuple[int, int]] = []
        self.launches: list[tuple[int, int]] = []
        self.drops = 0

    def observe_drop(self) -> None:
        self.drops += 1
        super().observe_drop()

    def observe_trip(self, batch_size: int, nanoseconds: int) -> None:
        self.trips.append((batch_size, nanoseconds))
        super().observe_trip(batch_size, nanoseconds)

    def observe_launch(self, batch_size: int, nanoseconds: int) -> None:
        self.launches.append((batch_size, nanoseconds))
        super().observe_launch(batch_size, nanoseconds)


def test_auto_depth_measures_the_trip_and_each_further_steps_launch(
    target_dir: Path, device: str
) -> None:
    """At auto the engine measures each trip (a round's request taking the step run ahead) and
    the host's launch of each further decode step (the step taken, the next launched); the
    tokens are the plain engine's (on the CPU no step's device time: the depth stays 1)."""
    plain, ahead = _both(target_dir, device)
    recorded = ahead.engine.ahead_depth = _Recorded()
    for driver in (plain, ahead):
        driver.begin("a", "b")
        for _ in range(3):
            driver.round(dict.fromkeys("ab", DraftTree()), steps={"a": 4, "b": 4})
    _same(plain, ahead)
    assert [size for size, _ in recorded.trips] == [2, 2, 2]
    assert [size for size, _ in recorded.launches] == [2] * 3 * 3  # steps 2-4 of each round
    assert all(ns > 0 for _, ns in recorded.trips + recorded.launches)
    assert recorded.drops == 0
    for driver in (plain, ahead):  # "b" leaves, "a" goes on: the step is taken for "a" alone
        driver.engine.release(["b"])
        del driver.tokens["b"], driver.committed["b"]
        driver.decode("a", rounds=1)
    assert recorded.drops == 0
    for driver in (plain, ahead):  # a round asking for hidden states: none of it the step
        driver.layers = (0,)
        driver.decode("a", rounds=1)
    _same(plain, ahead)
    assert recorded.drops == 1  # (auto then queues at most CHURN_DEPTH for a while)
    _release(plain, ahead)


def _queued(engine: VerifierEngine) -> int:
    """Decode steps run ahead and not yet taken: the step and those queued behind it."""
    queued, step = 0, engine._ahead
    while step is not None:
        queued, step = queued + 1, step.follower
    return queued


def test_the_steps_behind_a_rounds_last_step_are_queued_and_taken_in_turn(
    target_dir: Path, device: str, depth: int
) -> None:
    """After every round's last step `depth` steps are queued (a prefill's too), and rounds of
    one step and of several (decode_steps: the steps queued are their first and their own
    further ones) take them all: nothing is dropped, the tokens are the plain engine's."""
    plain, ahead = _both(target_dir, device, depth)
    for driver in (plain, ahead):
        driver.begin("a", "b")
        if driver is ahead:
            assert _queued(ahead.engine) == depth
        for steps in (1, 3, 1, 2, 4, 1):
            driver.round(dict.fromkeys("ab", DraftTree()), steps={"a": steps, "b": steps})
            if driver is ahead:
                assert _queued(ahead.engine) == depth
    _same(plain, ahead)
    assert ahead.engine.num_ahead_used == 1 + 3 + 1 + 2 + 4 + 1
    assert ahead.engine.num_ahead_dropped == 0
    _release(plain, ahead)
    assert ahead.engine.num_ahead_dropped == depth and _queued(ahead.engine) == 0


def test_steps_are_queued_behind_while_the_device_still_runs_each_step(
    target_dir: Path, device: str, depth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the device runs a step (here: every round reports itself unfinished, as a GPU's
    does until its results are copied) the host queues the steps behind the one run ahead up
    to `depth` (`top_up`, before each further step's wait): inside a round of several steps
    and across its end, the queue stays `depth` deep, every step is taken and the tokens are
    the plain engine's, sampled ones included (their draws in the same order)."""
    monkeypatch.setattr(VerifyRound, "ready", lambda self: False)
    plain, ahead = _both(target_dir, device, depth)
    sampling = SamplingParams(temperature=1.0, seed=3)
    queued_at_answer = []  # before the steps the service queues once the answer went out
    extend = ahead.engine.extend_ahead

    def extend_after_answer() -> bool:
        queued_at_answer.append(_queued(ahead.engine))
        return extend()

    monkeypatch.setattr(ahead.engine, "extend_ahead", extend_after_answer)
    for driver in (plain, ahead):
        driver.round(dict.fromkeys("ab", DraftTree()), begin=True, sampling=sampling)
        for steps in (4, 1, 3, 5):
            trees = dict.fromkeys("ab", DraftTree())
            driver.round(trees, sampling=sampling, steps={"a": steps, "b": steps})
            if driver is ahead:
                assert _queued(ahead.engine) == depth
                # a round of several steps queued them all while the device ran its steps
                assert steps == 1 or queued_at_answer[-1] == depth
    _same(plain, ahead)
    assert ahead.engine.num_ahead_used == 4 + 1 + 3 + 5
    assert ahead.engine.num_ahead_dropped == 0
    _release(plain, ahead)
    assert ahead.engine.num_ahead_dropped == depth and _queued(ahead.engine) == 0


def test_a_round_whose_sequences_stop_at_different_steps_keeps_the_steps_queued(
    target_dir: Path, device: str, depth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded sampling, the device busy at every look (steps queued behind up to `depth`): in a
    round where "b" asks for fewer decode steps than "a", the steps after "b"'s last are "a"'s
    alone and take the queued steps cut to "a" (`Launched.part`; "b"'s share of them undone, its
    draws put back). The tokens are the plain engine's."""
    monkeypatch.setattr(VerifyRound, "ready", lambda self: False)
    plain, ahead = _both(target_dir, device, depth)
    sampling = SamplingParams(temperature=1.0, seed=7)
    for driver in (plain, ahead):
        driver.round(dict.fromkeys("ab", DraftTree()), begin=True, sampling=sampling)
        for steps in ({"a": 4, "b": 2}, {"a": 3, "b": 1}, {"a": 2, "b": 2}):
            driver.round(dict.fromkeys("ab", DraftTree()), sampling=sampling, steps=steps)
    _same(plain, ahead)
    _release(plain, ahead)


def _three_served_rounds(
    engine: VerifierEngine, answered: Callable[[bool], Awaitable[None]]
) -> None:
    """Sequence "a"'s prefill and two decode rounds through `PipelinedRounds` (the service on
    a GPU: engine calls on the loop), `answered(begin)` awaited as each answer is out; then
    every step was taken and the release drops the 3 queued."""

    async def call(fn: Callable[..., object], *args: object) -> object:
        return fn(*args)

    async def rounds() -> None:
        pipelined = PipelinedRounds(engine, call)
        committed, pending = 0, list(PROMPTS["a"])
        for begin in (True, False, False):
            outputs, _, _ = await pipelined.verify(
                [VerifyInput("a", begin, committed, pending, DraftTree())]
            )
            await answered(begin)
            committed, pending = outputs[0].kv_committed_len, [outputs[0].bonus_token]

    asyncio.run(rounds())
    assert (engine.num_ahead_used, engine.num_ahead_dropped) == (2, 0)
    engine.release(["a"])
    assert engine.num_ahead_dropped == 3 and engine.num_pages_used == 0


def test_the_service_queues_the_steps_behind_while_the_device_runs_the_round(
    target_dir: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through `PipelinedRounds`: a round the device has not finished (here: its first two
    looks at it) has the steps behind the one run ahead queued before the service waits for
    it, so the answer goes out with all `depth` queued and nothing is left for after it."""
    engine = _engine(target_dir, True, device, depth=3)
    looks: dict[int, int] = {}
    # every round looked at, kept alive: a round freed would let a later one take its id (and
    # its count: "ready" at its first look, with fewer steps queued; seen once in CI)
    seen: list[VerifyRound] = []

    def ready(launched: VerifyRound) -> bool:  # unfinished at the first two looks
        seen.append(launched)
        looks[id(launched)] = looks.get(id(launched), 0) + 1
        return looks[id(launched)] > 2

    monkeypatch.setattr(VerifyRound, "ready", ready)

    async def answered(begin: bool) -> None:
        assert _queued(engine) == 3

    _three_served_rounds(engine, answered)


def test_the_service_queues_the_steps_behind_once_the_answer_went_out(
    target_dir: Path, device: str
) -> None:
    """Through `PipelinedRounds` (the service on a GPU): the steps behind the one run ahead are
    queued once the round's task has answered (a task of their own on the loop), so their
    launches do not hold the answer back."""
    engine = _engine(target_dir, True, device, depth=3)

    async def answered(begin: bool) -> None:
        # the answer goes out first: with the step run ahead (after the prefill), or the
        # steps that were queued behind the one this round took
        assert _queued(engine) == (1 if begin else 2)
        await asyncio.sleep(0)  # one a turn of the loop: a request waits for one at most
        assert _queued(engine) == (2 if begin else 3)
        await asyncio.sleep(0)
        assert _queued(engine) == 3

    _three_served_rounds(engine, answered)


@pytest.mark.parametrize("drafted", [("a",), ("a", "b")])
def test_a_tree_round_takes_the_step_for_the_sequences_without_a_tree(
    target_dir: Path, device: str, depth: int, drafted: tuple[str, ...]
) -> None:
    """A round with trees for some sequences takes the step run ahead for the others and runs
    the trees beside it; the step queued behind it goes on (the next round takes it for those
    others, and the sequence back to decoding joins them: `_join_ahead`); with a tree for
    every sequence it drops the step."""
    plain, ahead = _both(target_dir, device, depth)
    for driver in (plain, ahead):
        driver.begin("a", "b")
        driver.decode("a", "b", rounds=3)
        trees = {s: _chain(target_dir, device, driver, s, 2) for s in drafted}
        outputs = driver.round({"a": trees["a"], "b": trees.get("b", DraftTree())})
        assert outputs[0].accepted_tokens == trees["a"].tokens[:2]
        driver.decode("a", "b", rounds=3)
    _same(plain, ahead)
    # 3 + 3 decode rounds and "b"'s share in the tree round when "a" alone sends one (at
    # depth 1 the round after it has none: the tree's sequence cannot run ahead; above, the
    # step queued behind "b"'s, and then "a" joins it), else all dropped
    if drafted == ("a",):
        used, dropped = (6, 0) if depth == 1 else (7, depth - 2)
        assert (ahead.engine.num_ahead_used, ahead.engine.num_ahead_dropped) == (used, dropped)
    else:  # by the round with a tree for each: it asked for none of the step
        assert (ahead.engine.num_ahead_used, ahead.engine.num_ahead_dropped) == (5, depth)
        assert ahead.engine.num_ahead_dropped_by == {"unasked": depth}
    _release(plain, ahead)


@pytest.mark.parametrize("seed", [None, 13], ids=["greedy", "sampled"])
def test_a_sequence_joining_takes_the_step_for_the_others(
    target_dir: Path, device: str, depth: int, seed: int | None
) -> None:
    """As the gateway sends it, a newcomer's first round beside the running sequences' next
    step: that step is taken, the newcomer's prefill runs beside it, and the next round's step
    covers both: at depth 1 one launched for both, above it the step queued behind the one
    taken with the newcomer's next step launched beside it, as one (`_join_ahead`; the steps
    queued behind those, "a"'s alone, dropped). Seeded sampling draws as without them."""
    plain, ahead = _both(target_dir, device, depth)
    sampling = SamplingParams() if seed is None else SamplingParams(temperature=0.9, seed=seed)
    for driver in (plain, ahead):
        driver.round({"a": DraftTree()}, begin=True, sampling=sampling)
        for _ in range(2):
            driver.round({"a": DraftTree()}, sampling=sampling)
        driver.round({"a": DraftTree(), "b": DraftTree()}, begin={"b"}, sampling=sampling)
        for _ in range(3):
            driver.round(dict.fromkeys("ab", DraftTree()), sampling=sampling)
    _same(plain, ahead)
    assert ahead.engine.num_ahead_used == 6
    assert ahead.engine.num_ahead_dropped == max(0, depth - 2)
    assert ahead.engine.num_ahead_dropped_by == ({"joined": 1} if depth == 3 else {})
    _release(plain, ahead)


def test_a_newcomer_in_a_round_of_several_steps_joins_past_the_batch_cap(
    target_dir: Path, device: str, depth: int
) -> None:
    """A newcomer's first round of 3 decode steps beside the running sequence's: the round's own
    further steps run ahead at any batch size, so past decode_ahead_max_batch (1 here) the
    newcomer's next step still joins the step queued behind the one taken."""
    plain, ahead = _both(target_dir, device, depth)
    engine = ahead.engine
    engine.decode_ahead_max_batch = 1
    joins, join = [], engine._join_ahead  # each join's sequences

    def recorded(queued: Launched, new: Launched, capped: bool = True) -> Launched:
        joined = join(queued, new, capped)
        joins.append(sorted(item.seq_id for item in joined.inputs))
        return joined

    engine._join_ahead = recorded  # type: ignore[method-assign]
    for driver in (plain, ahead):
        driver.begin("a")
        driver.decode("a", rounds=2)
        driver.round(dict.fromkeys("ab", DraftTree()), begin={"b"}, steps={"a": 3, "b": 3})
        driver.round(dict.fromkeys("ab", DraftTree()), steps={"a": 2, "b": 2})
    _same(plain, ahead)
    # 2 + the round "b" joins: 1 + 2 further; the next: its further step only (past the cap
    # nothing runs ahead after a round's last step); the steps queued behind the one that goes
    # on (depth 3) dropped
    assert ahead.engine.num_ahead_used == 2 + 3 + 1
    assert ahead.engine.num_ahead_dropped == max(0, depth - 2)
    assert joins == ([] if depth == 1 else [["a", "b"]])  # (depth 1 queues no step behind)
    _release(plain, ahead)


@pytest.mark.parametrize("before", [0, 1, 2, 3], ids=lambda n: f"after{n}")
def test_a_newcomer_writes_the_pages_the_dropped_steps_gave_back(
    target_dir: Path, device: str, depth: int, before: int
) -> None:
    """A newcomer whose first round drops the steps queued behind the running sequence's
    (those behind the one that goes on: `_join_ahead`; not waited for: on a GPU they may still
    be running) gets the page they held when the last of them crossed a page boundary (freed
    pages go out first), and its prefill's K/V land after theirs: the same tokens and K/V as
    without steps run ahead, wherever the boundary falls ("a" has 7 tokens, pages of 4
    slots)."""
    plain, ahead = _both(target_dir, device, depth)
    reused = False
    for driver in (plain, ahead):
        driver.begin("a")
        driver.decode("a", rounds=before)
        held = set(driver.engine.seqs["a"].kv.page_table)  # with the steps queued behind
        driver.round({"a": DraftTree(), "b": DraftTree()}, begin={"b"})
        reused |= driver is ahead and bool(held & set(driver.engine.seqs["b"].kv.page_table))
        driver.decode("a", "b", rounds=3)
    _same(plain, ahead)
    # "a"'s first step and the one queued behind it go on (`_join_ahead`); the third, at depth
    # 3 (slot 9 + before), alone reaches a page of its own (slot 12)
    assert reused == (before == 3 and depth == 3)
    _release(plain, ahead)


@pytest.mark.parametrize("change", ["one leaves", "one joins", "order", "hidden states"])
def test_another_batch_takes_the_step_unless_none_of_it_is_that_step(
    target_dir: Path, device: str, depth: int, change: str
) -> None:
    plain, ahead = _both(target_dir, device, depth)
    for driver in (plain, ahead):
        driver.begin("a", "b") if change != "one joins" else driver.begin("a")
        driver.decode(*driver.tokens, rounds=3)
        if change == "one leaves":
            driver.engine.release(["b"])  # "a"'s next round takes its share of the step
            del driver.tokens["b"], driver.committed["b"]
            driver.decode("a", rounds=3)
        elif change == "one joins":
            driver.begin("b")
            driver.decode("a", "b", rounds=3)
        elif change == "order":
            driver.decode("b", "a", rounds=3)
        else:
            inputs = [
                VerifyInput("a", False, driver.committed["a"], driver.tokens["a"][-1:],
                            DraftTree(), hidden_state_layers=(0, 1))
            ]  # fmt: skip
            out = driver.engine.verify(inputs)[0]
            assert out.hidden_states is not None and out.hidden_states.shape[0] == 1
            driver.tokens["a"].append(out.bonus_token)
            driver.committed["a"] = out.kv_committed_len
            driver.decode("a", "b", rounds=2)
    _same(plain, ahead)
    if change in ("one leaves", "order"):  # each round takes the step for its sequences
        # and the steps queued behind it, cut to them alike (`Launched.part`): none dropped
        assert ahead.engine.num_ahead_dropped == 0
        assert ahead.engine.num_ahead_used == 6
        assert _queued(ahead.engine) == depth
    else:  # a newcomer's round alone, a round asking for hidden states: none of it the step
        assert ahead.engine.num_ahead_dropped >= 1
        assert ahead.engine.num_ahead_used >= 3
    _release(plain, ahead)


def test_truncation_and_refusals_leave_no_step_run_ahead(
    target_dir: Path, device: str, depth: int
) -> None:
    plain, ahead = _both(target_dir, device, depth)
    for driver in (plain, ahead):
        driver.begin("a")
        driver.decode("a", rounds=4)
        # a refused round (wrong committed length) changes nothing, the step stays usable
        bad = VerifyInput("a", False, driver.committed["a"] + 1, [3], DraftTree())
        with pytest.raises(ServiceError, match="kv_committed_len"):
            driver.engine.verify([bad])
        driver.decode("a", rounds=1)
        keep = driver.committed["a"] - 2
        [done] = driver.engine.truncate([Truncation("a", keep)])
        assert done.found and done.kv_committed_len == keep
        driver.tokens["a"] = driver.tokens["a"][: keep + 1]  # the last one pending again
        driver.committed["a"] = keep
        driver.decode("a", rounds=3)
    _same(plain, ahead)
    assert ahead.engine.num_ahead_dropped == depth  # by the truncation (a refusal keeps them)
    assert ahead.engine.num_ahead_dropped_by == {"truncated": depth}
    _release(plain, ahead)


@pytest.mark.parametrize("seed", [5, None], ids=["seeded", "unseeded"])
def test_sampled_rounds_run_ahead_and_a_dropped_step_gives_its_draws_back(
    target_dir: Path, device: str, depth: int, seed: int | None
) -> None:
    """Seeded sampling gives the same tokens with steps run ahead, also when one is dropped
    (its draws are put back): the greedy prefill's step, dropped by the first sampled round;
    after 3 rounds of "a", "b" the order turns to "b", "a" (taken as well); then "b" leaves and
    "a" samples on (its share of the step run ahead taken, and of the steps queued behind it:
    "b"'s draws in them go back with the step's). Unseeded: each run draws at random, so only
    the counts."""
    plain, ahead = _both(target_dir, device, depth)
    sampling = SamplingParams(temperature=0.8, seed=seed)
    for driver in (plain, ahead):
        driver.begin("a", "b")  # greedy prefill
        for order in [("a", "b")] * 3 + [("b", "a")] * 3:
            driver.round(dict.fromkeys(order, DraftTree()), sampling=sampling)
        driver.engine.release(["b"])
        del driver.tokens["b"], driver.committed["b"]
        for _ in range(2):
            driver.round({"a": DraftTree()}, sampling=sampling)
    if seed is not None:
        _same(plain, ahead)
    # the greedy prefill's, by a sampled round (the others taken, cut to the round's sequences)
    assert ahead.engine.num_ahead_dropped == depth
    assert ahead.engine.num_ahead_used == 2 + 3 + 2
    _release(plain, ahead)


def test_a_sequence_sitting_out_gets_back_the_draws_of_the_steps_queued_for_it(
    target_dir: Path, device: str, depth: int
) -> None:
    """Seeded sampling: "b" decodes alone for two rounds while "a" (alive) sits them out, then
    both go on. The first of them takes the step run ahead and the steps queued behind it for
    "b" (`Launched.part`); "a"'s share of all of them is undone: its room past its committed
    length and its generator's state from before the first of them drew. The tokens are the
    plain engine's."""
    plain, ahead = _both(target_dir, device, depth)
    sampling = SamplingParams(temperature=0.9, seed=11)
    for driver in (plain, ahead):
        driver.round(dict.fromkeys("ab", DraftTree()), begin=True, sampling=sampling)
        for seq_ids in ["ab"] * 3 + ["b"] * 2 + ["ab"] * 2:
            driver.round(dict.fromkeys(seq_ids, DraftTree()), sampling=sampling)
    _same(plain, ahead)
    # every round takes the step run ahead ("b"'s share when "a" rejoins, beside "a"'s own
    # launch; the step queued behind it goes on with "a"'s next step launched beside it, and
    # the one behind that, "b"'s alone, is dropped: `_join_ahead`)
    assert ahead.engine.num_ahead_used == 3 + 2 + 2
    assert ahead.engine.num_ahead_dropped == max(0, depth - 2)
    _release(plain, ahead)


def test_no_step_runs_ahead_without_a_free_page(target_dir: Path, device: str, depth: int) -> None:
    # 3 pages of 4 slots; prompt "a" has 7 tokens: 5 decode rounds commit 12, the 13th slot
    # would need a 4th page
    engine = _engine(target_dir, True, device, num_pages=3, depth=depth)
    driver = Driver(engine)
    driver.begin("a")
    driver.decode("a", rounds=5)
    assert driver.committed["a"] == 12 and engine.num_pages_free == 0
    assert engine.num_ahead_used == 5  # the last one reserved the 12th slot, no 13th
    engine.release(["a"])
    assert engine.num_ahead_dropped == 0  # nothing was run ahead to drop
    assert engine.num_pages_used == 0


def test_a_newcomer_refused_for_memory_leaves_the_others_as_they_were(
    target_dir: Path, device: str, depth: int
) -> None:
    """3 pages of 4 slots, all "a"'s (9 committed, the 10th slot run ahead): "b" joining is
    refused (RESOURCE_EXHAUSTED) after the step was taken for "a"; nothing is committed, "a"'s
    room is its own again, and sent alone its next rounds give the plain engine's tokens."""
    plain = Driver(_engine(target_dir, False, device, num_pages=3))
    ahead = Driver(_engine(target_dir, True, device, num_pages=3, depth=depth))
    for driver in (plain, ahead):
        driver.begin("a")
        driver.decode("a", rounds=2)
        assert driver.committed["a"] == 9 and driver.engine.num_pages_free == 0
        with pytest.raises(ServiceError) as refused:
            driver.round({"a": DraftTree(), "b": DraftTree()}, begin={"b"})
        assert refused.value.code == Code.RESOURCE_EXHAUSTED
        del driver.tokens["b"], driver.committed["b"]
        assert set(driver.engine.seqs) == {"a"} and driver.committed["a"] == 9
        driver.engine.check_integrity()
        driver.decode("a", rounds=2)
    _same(plain, ahead)
    _release(plain, ahead)


@pytest.mark.parametrize("mixed", [False, True], ids=["target-only", "some-speculate"])
def test_the_gateway_gets_the_target_tokens_with_steps_run_ahead(
    target_dir: Path, smollm2_tokenizer: object, mixed: bool
) -> None:
    """Through the scheduler: sequences ending at different rounds (the batch shrinks), and
    with some requests speculating, rounds alternating between plain and tree rounds."""
    requests = mixed_requests(5, seed=3, max_new_tokens=6)
    for i, request in enumerate(requests):
        request.max_new_tokens = 6 + 3 * i
        request.spec = SpecParams(2, 1, 2) if mixed and i % 2 else SpecParams(0, 1, 0)
    expected = target_only_ids(target_dir, smollm2_tokenizer, requests)
    stack = make_stack(target_dir, "ngram", smollm2_tokenizer, SpecParams(0, 1, 0),
                       decode_ahead=True)  # fmt: skip
    assert [generated_ids(c) for c in generate_all(stack, requests)] == expected
    assert stack.verifier.num_ahead_used > 0


def test_each_step_run_ahead_is_reported_once_and_warm_up_is_not(
    target_dir: Path, device: str, depth: int
) -> None:
    engine = _engine(target_dir, True, device, depth=depth)
    reported: list[str] = []
    reasons: list[str] = []
    engine.on_decode_ahead = reported.append  # the verifier service counts these in /metrics
    engine.on_decode_ahead_dropped = reasons.append  # and the drops by why
    engine.warmup()  # its rounds are not traffic
    assert reported == [] and engine.num_ahead_used == engine.num_ahead_dropped == 0
    assert reasons == [] and not engine.num_ahead_dropped_by
    driver = Driver(engine)
    driver.begin("a")
    driver.decode("a", rounds=3)
    engine.release(["a"])
    assert reported == ["used"] * 3 + ["dropped"] * depth
    assert reasons == ["released"] * depth and engine.num_ahead_dropped_by == {"released": depth}


def test_rounds_past_the_batch_limit_run_nothing_ahead(
    target_dir: Path, device: str, depth: int
) -> None:
    engine = _engine(target_dir, True, device, depth=depth)
    engine.decode_ahead_max_batch = 1
    driver = Driver(engine)
    driver.begin("a", "b")
    driver.decode("a", "b", rounds=3)
    engine.release(["a"])
    driver.decode("b", rounds=3)
    assert engine.num_ahead_used == 2  # "b" alone: its second and third rounds
    assert engine.num_ahead_dropped == 0
    engine.release(["b"])


def test_a_draft_ahead_round_without_a_hint_runs_no_step_ahead(
    target_dir: Path, device: str, depth: int
) -> None:
    """Rounds the gateway marks unhinted (draft-ahead with no hint: its plain items are
    misses, whose next round carries a tree where the drafter guessed the outcome) launch no
    decode step ahead, which would mostly be dropped and hold that round behind it on the
    device; the tokens are the same."""
    plain, ahead = _both(target_dir, device, depth)
    for driver in (plain, ahead):
        driver.begin("a", "b")
        driver.unhinted = True
        driver.decode("a", "b", rounds=2)  # (the first takes the prefill's step ahead)
    used, dropped = ahead.engine.num_ahead_used, ahead.engine.num_ahead_dropped
    for driver in (plain, ahead):
        driver.decode("a", "b", rounds=3)
    assert (ahead.engine.num_ahead_used, ahead.engine.num_ahead_dropped) == (used, dropped)
    assert ahead.engine._ahead is None
    _same(plain, ahead)
    for driver in (plain, ahead):
        driver.unhinted = False
        driver.decode("a", "b", rounds=2)  # plain rounds run ahead again
    assert ahead.engine.num_ahead_used == used + 1
    _same(plain, ahead)
    _release(plain, ahead)


def test_releasing_or_truncating_another_sequence_keeps_the_step_run_ahead(
    target_dir: Path, device: str, depth: int
) -> None:
    plain, ahead = _both(target_dir, device, depth)
    for driver in (plain, ahead):
        driver.begin("a")
        driver.begin("b")
        driver.decode("a", rounds=2)  # "b" waits (a session between turns, say)
        driver.engine.truncate([Truncation("b", 2)])
        driver.tokens["b"], driver.committed["b"] = driver.tokens["b"][:3], 2
        assert driver.engine.release(["nobody"]) == 0  # an empty Release: the pages count
        driver.decode("a", rounds=2)
    _same(plain, ahead)
    # dropped: the prefills' steps ("a"'s by "b"'s prefill, "b"'s by "a"'s round); then the
    # truncation of "b" and the empty Release keep "a"'s, so its 3 later rounds take theirs
    assert ahead.engine.num_ahead_dropped == 2 * depth
    assert ahead.engine.num_ahead_used == 3
    _release(plain, ahead)
