"""Hinted rounds chained on the device behind the round they follow (verifier/chain.py): with the
gateway's hint for a round in flight, the next round is queued right behind it, built for one
outcome and placed on the outcome that came by device ops. Whatever came (an outcome among the
hint's or not) and whatever the gateway sends next, the tokens and the committed KV are those
of an engine without hints, and no page stays held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specsplit.cli_flags import CHAIN_MIN_GUESS_RATE
from specsplit.messages import AheadTree, NextTrees, VerifyInput, VerifyOutput
from specsplit.tree import DraftTree
from tests.support import save_tiny_llama
from tests.unit.test_decode_ahead import PROMPTS, Driver, _chain, _engine, _release, _same
from verifier.chain import resolve
from verifier.chain_gate import (
    CHAIN_MIN_SAMPLES,
    CHAIN_PAYS_MARGIN,
    CHAIN_PROBE_EVERY,
    CHAIN_WINDOW,
    ChainGate,
)
from verifier.engine import VerifierEngine
from verifier.hints import GUESS_MIN_ROUNDS, GUESS_WINDOW, HintBook


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("round_chain") / "target", seed=31)


@pytest.fixture(scope="module")
def device() -> str:
    """The engines' device (tests/gpu runs these tests on CUDA, with the graphs)."""
    return "cpu"


PHASES: list[str] = []  # the chained engine's last run's host phases (on_gap) and waits
WAITS: list[float] = []


def _shaped_like(tree: DraftTree, shift: int) -> DraftTree:
    """A tree of `tree`'s shape with other tokens (a wrong outcome's)."""
    return DraftTree([(t + shift) % 256 for t in tree.tokens], list(tree.parents))


def _chained_engine(
    target_dir: Path, device: str, page_size: int, still_running: bool = True, **kwargs: object
) -> Driver:
    """An engine that chains every hint for a round in flight. `still_running`: as if the GPU
    still ran that round (the tiny rounds may be done there before their hint comes; the check
    itself: test_a_hint_for_a_round_the_gpu_is_done_with_launches_after_the_answer); False:
    the engine's own check."""
    driver = Driver(_engine(target_dir, False, device, page_size=page_size))
    driver.engine.launch_on_hint = True  # the service's, where its calls run on the loop
    driver.engine.chain_rounds = True
    driver.engine.chain_max_batch = 64
    driver.engine.chain_min_guess_rate = 0.0  # whatever the hints guessed before
    if still_running:
        driver.engine._still_running = lambda launched: True  # type: ignore[method-assign]
    for name, value in kwargs.items():
        setattr(driver.engine, name, value)
    return driver


def _run(
    target_dir: Path,
    device: str,
    rounds: int,
    page_size: int = 4,
    guessed: tuple[str, ...] = ("a", "b"),
    nodes: int = 3,
    misses_plain: bool = False,
    layers: tuple[int, ...] = (),
    **chained_attrs: object,
) -> tuple[Driver, Driver, list[bool]]:
    """`rounds` rounds of chains of `nodes` for "a" and "b" on a plain engine and on one whose
    hint for each round comes while it is in flight: the next round's tree for the outcome
    the plain engine saw (for the sequences in `guessed`; the others' hint has wrong outcomes
    only) beside a wrong outcome's of the same shape (`chained_attrs`: the chaining engine's
    attributes set). `misses_plain`: the hints run misses plain, and a sequence not in `guessed` is
    sent the plain round (no tree) after each miss, as the gateway does. `layers`: every
    round asks for these layers' hidden states. Returns the drivers and whether each round
    had its next one chained."""
    plain = Driver(_engine(target_dir, False, device, page_size=page_size), layers)
    chained = _chained_engine(target_dir, device, page_size, **chained_attrs)
    chained.layers = layers
    for driver in (plain, chained):
        driver.begin("a", "b")
    chained.engine.on_gap = lambda phase, _: PHASES.append(phase)
    chained.engine.on_wait = WAITS.append
    rights = {"a": [2, 0, 3, 1], "b": [1, 3, 0, 2]}  # right tokens per round, in turn
    trees = {s: _padded(_chain(target_dir, device, plain, s, 1), nodes) for s in "ab"}
    was_chained = []
    for r in range(rounds):
        bases = {s: len(plain.tokens[s]) for s in "ab"}
        plain.round(trees)
        following = {
            s: _padded(_chain(target_dir, device, plain, s, max(1, rights[s][r % 4])), nodes)
            for s in "ab"
        }
        hints = []
        for s in "ab":
            outcome = plain.tokens[s][bases[s] :]
            wrong = AheadTree(
                [*outcome[:-1], (outcome[-1] + 1) % 256], _shaped_like(following[s], 5)
            )
            right = AheadTree(outcome, following[s])
            outcomes = [wrong, right] if s in guessed else [wrong]
            hints.append(NextTrees(s, bases[s], outcomes, plain=misses_plain))
        engine = chained.engine
        seen: list[bool] = []

        def hint(
            engine: VerifierEngine = engine, hints: list[NextTrees] = hints, seen: list[bool] = seen
        ) -> None:
            engine.hint_next(hints)
            seen.append(engine._in_flight[0].chained is not None)

        chained.round(trees, meanwhile=hint)
        was_chained += seen
        trees = {s: following[s] if s in guessed or not misses_plain else DraftTree() for s in "ab"}
    return plain, chained, was_chained


def _room(driver: Driver) -> int:
    """The pages a chained round not yet taken may hold: each sequence's pending token and
    tree past its longest outcome's end."""
    ahead = driver.engine._ahead
    if ahead is None:
        return len(driver.engine.seqs)
    page_size = driver.engine.kv.page_size
    return sum(-(-(1 + 2 * len(item.tree)) // page_size) + 1 for item in ahead.inputs)


def _padded(tree: DraftTree, nodes: int) -> DraftTree:
    """`tree` (a chain) cut or lengthened to `nodes` nodes (wrong tokens past its end)."""
    tokens = list(tree.tokens[:nodes])
    while len(tokens) < nodes:
        tokens.append((tokens[-1] + 3) % 256)
    return DraftTree(tokens, list(range(-1, nodes - 1)))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_chained_rounds_are_taken_and_give_the_same_tokens(
    target_dir: Path, device: str, page_size: int
) -> None:
    PHASES.clear()
    WAITS.clear()
    plain, chained, was_chained = _run(target_dir, device, rounds=6, page_size=page_size)
    assert was_chained == [True] * 6
    # each round's host work: its finish, and the next round chained while it was in flight;
    # the device waited before the first (after the begin round), for no round after it
    assert PHASES == ["chain", "finish"] * 6
    assert len(WAITS) == 7 and WAITS[0] > 0 and WAITS[1:] == [0.0] * 6
    _same(plain, chained, _room(chained))
    engine = chained.engine
    assert (engine.num_next_used, engine.num_next_dropped) == (5, 0)
    assert not engine.hints.num_not_ahead
    _release(plain, chained)


def test_an_outcome_not_among_the_hints_drops_only_its_share(target_dir: Path, device: str) -> None:
    """ "b"'s hint never has its outcome: each chained round is taken for "a" only ("b"'s share
    dropped, its room freed), and "b"'s next round runs beside it."""
    plain, chained, was_chained = _run(target_dir, device, rounds=5, guessed=("a",))
    _same(plain, chained, _room(chained))
    engine = chained.engine
    assert was_chained == [True] * 5
    assert (engine.num_next_used, engine.num_next_dropped) == (4, 0)
    assert engine.hints.num_not_ahead == {"unguessed": 5}
    _release(plain, chained)


@pytest.mark.parametrize("guessed", [("a",), ()], ids=["b-missed", "both-missed"])
def test_a_miss_run_plain_is_placed_as_the_plain_round_and_taken(
    target_dir: Path, device: str, guessed: tuple[str, ...]
) -> None:
    """Hints that run misses plain (the gateway's default): the chained round of a sequence
    whose outcome was not among its hint's is placed on the device as the plain round the
    gateway sends for a miss (r's bonus token, no drafts accepted) and taken for it, its
    reference tree's room freed; nothing is dropped, and the tokens and the committed KV are
    an engine's without hints."""
    plain, chained, was_chained = _run(
        target_dir, device, rounds=5, guessed=guessed, misses_plain=True, chain_min_guess_rate=0.9
    )
    engine = chained.engine
    assert was_chained == [False] * (GUESS_MIN_ROUNDS // 2) + [True]  # the rate counts them
    assert engine.hints.guess_rate() == 1.0
    _same(plain, chained, _room(chained))
    plain2, chained2, was_chained2 = _run(
        target_dir, device, rounds=5, guessed=guessed, misses_plain=True
    )
    assert was_chained2 == [True] * 5
    assert (chained2.engine.num_next_used, chained2.engine.num_next_dropped) == (4, 0)
    assert not chained2.engine.hints.num_not_ahead  # (no "unguessed")
    _same(plain2, chained2, _room(chained2))
    _release(plain, chained)
    _release(plain2, chained2)


def test_a_round_placed_plain_frees_its_reference_trees_room(target_dir: Path, device: str) -> None:
    """A chained round placed plain was given the room of its reference tree: taken for the
    plain round, its commit frees what lies past the committed tokens (no round chained behind
    it holds it)."""
    plain, chained, _ = _run(target_dir, device, rounds=3, guessed=(), misses_plain=True)
    engine = chained.engine
    assert engine._ahead is not None  # the last round's, placed plain: taken now, no hint
    for driver in (plain, chained):
        driver.round({s: DraftTree() for s in "ab"})
    assert engine.num_next_used == 3 and engine._ahead is None
    for seq_id in "ab":
        kv = engine.seqs[seq_id].kv
        assert len(kv.page_table) == -(-kv.kv_committed_len // engine.kv.page_size)
    _same(plain, chained, 0)
    _release(plain, chained)


@pytest.mark.parametrize("misses_plain", [True, False], ids=["placed-plain", "dropped"])
def test_a_round_accepting_more_than_the_hints_longest_outcome_stays_in_its_room(
    target_dir: Path, device: str, misses_plain: bool
) -> None:
    """A hint need not name every accept length (the gateway leaves out outcomes that would
    finish the sequence): a round that accepts more drafts than the hint's longest outcome has
    its chained round placed past that outcome's end, so the room is reserved for the whole
    tree accepted. The miss is placed plain and taken (or dropped), and the tokens and the
    committed KV are an engine's without hints (page size 1: no slack in the room)."""
    plain = Driver(_engine(target_dir, False, device, page_size=1))
    chained = _chained_engine(target_dir, device, 1)
    for driver in (plain, chained):
        driver.begin("a")
    tree = _chain(target_dir, device, plain, "a", 2)  # the target's next 2 tokens, a wrong one
    base = len(plain.tokens["a"])
    plain.round({"a": tree})
    assert len(plain.tokens["a"]) - base == 3  # 2 drafts accepted and the bonus token
    short = AheadTree([(plain.tokens["a"][base] + 1) % 256], DraftTree([1, 2, 3], [-1, 0, 1]))
    hint = NextTrees("a", base, [short], plain=misses_plain)  # only an outcome of no drafts
    engine = chained.engine
    chained.round({"a": tree}, meanwhile=lambda: engine.hint_next([hint]))
    assert engine._ahead is not None and engine._ahead.chain_hints is not None  # chained
    for driver in (plain, chained):
        driver.round({"a": DraftTree()})
    assert (engine.num_next_used, engine.num_next_dropped) == ((1, 0) if misses_plain else (0, 1))
    _same(plain, chained, _room(chained))
    _release(plain, chained)


def test_rounds_with_hidden_states_chain_and_give_the_same_rows(
    target_dir: Path, device: str
) -> None:
    """An EAGLE drafter's rounds ask for the target's hidden states: their next rounds chain
    too, with the same layers, and each round's rows (its pending token's, then its accepted
    path's) are an engine's without hints, for an outcome guessed ("a") and a miss placed plain
    ("b") alike."""
    plain, chained, was_chained = _run(
        target_dir, device, rounds=5, guessed=("a",), misses_plain=True, layers=(0, 1)
    )
    assert was_chained == [True] * 5
    engine = chained.engine
    assert (engine.num_next_used, engine.num_next_dropped) == (4, 0)
    _same(plain, chained, _room(chained))
    for seq_id in "ab":  # the begin round's and each round's
        assert len(chained.hidden[seq_id]) == len(plain.hidden[seq_id]) == 6
        for got, want in zip(chained.hidden[seq_id], plain.hidden[seq_id], strict=True):
            assert got.shape[1] == 2 * 64  # two layers of the tiny model's width
            # bfloat16 rows: one unit in the last place apart where a batch rounds differently
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    _release(plain, chained)


def test_the_last_chained_round_is_dropped_by_a_release(target_dir: Path, device: str) -> None:
    """The round chained after the last one is never asked for: releasing the sequences drops
    it and frees every page."""
    plain, chained, _ = _run(target_dir, device, rounds=2)
    assert chained.engine._ahead is not None
    _same(plain, chained, _room(chained))
    _release(plain, chained)
    assert chained.engine._ahead is None and chained.engine.num_next_dropped == 1


def test_trees_of_different_shapes_are_launched_after_the_round(
    target_dir: Path, device: str
) -> None:
    """A hint whose outcomes' trees differ in shape cannot be placed on the device: the round
    is not chained, and the hinted round launches once the answer went out, as before."""
    plain = Driver(_engine(target_dir, False, device))
    chained = _chained_engine(target_dir, device, 4)
    for driver in (plain, chained):
        driver.begin("a")
    tree = _chain(target_dir, device, plain, "a", 2)
    base = len(plain.tokens["a"])
    plain.round({"a": tree})
    outcome = plain.tokens["a"][base:]
    following = _chain(target_dir, device, plain, "a", 1)
    other = DraftTree([1], [-1])  # one node where `following` has two
    hint = NextTrees("a", base, [AheadTree([7], other), AheadTree(outcome, following)])
    engine = chained.engine
    chained.round({"a": tree}, meanwhile=lambda: engine.hint_next([hint]))
    assert engine._ahead is None  # parked: launched once the answer went out
    engine.launch_parked()
    assert engine._ahead is not None
    plain.round({"a": following})
    chained.round({"a": following})
    assert engine.num_next_used == 1
    _same(plain, chained, _room(chained))
    _release(plain, chained)


def test_a_hint_for_a_round_the_gpu_is_done_with_launches_after_the_answer(
    target_dir: Path, device: str
) -> None:
    """The round in flight already done on the GPU when its hint comes (the drafter's
    draft-ahead call outlasting the verify): the next round is not chained (the chain's host
    work would hold the answer back, and start that round no sooner) but launched once the
    answer went out, and taken: the same tokens as an engine without hints. On a GPU the
    device is synchronized before the hint; on the CPU, where a round is done when launched
    and chains all the same, the engine is told the GPU is done with it."""
    plain = Driver(_engine(target_dir, False, device))
    chained = _chained_engine(target_dir, device, 4, still_running=False)
    engine = chained.engine
    if device == "cpu":  # (a CPU round is done when launched, and chains there)
        engine._still_running = lambda launched: False  # type: ignore[method-assign]
    for driver in (plain, chained):
        driver.begin("a")
    tree = _chain(target_dir, device, plain, "a", 2)
    for _ in range(3):
        base = len(plain.tokens["a"])
        plain.round({"a": tree})
        outcome = plain.tokens["a"][base:]
        following = _chain(target_dir, device, plain, "a", 1)
        hint = NextTrees("a", base, [AheadTree(outcome, following)])

        def done_then_hint(hint: NextTrees = hint) -> None:
            if device == "cuda":
                torch.cuda.synchronize()
            engine.hint_next([hint])
            assert engine._in_flight[0].chained is None

        chained.round({"a": tree}, meanwhile=done_then_hint)
        assert engine._ahead is None  # parked: launched once the answer went out
        engine.launch_parked()
        assert engine._ahead is not None
        tree = following
    plain.round({"a": tree})
    chained.round({"a": tree})
    assert (engine.num_next_used, engine.num_next_dropped) == (3, 0)
    _same(plain, chained, _room(chained))
    _release(plain, chained)


def test_synthetic_acceptance_bends_the_placed_tokens(target_dir: Path, device: str) -> None:
    """Benchmarks' synthetic acceptance on a chained round bends the logits of the tokens placed
    on the device (the outcome that came), not the reference's: the same outcomes as an engine
    without hints."""
    rates = (0.8, 0.5, 0.3)
    plain = Driver(_engine(target_dir, False, device))
    plain.engine.synthetic_acceptance = rates
    chained = _chained_engine(target_dir, device, 4, synthetic_acceptance=rates)
    for driver in (plain, chained):
        driver.begin("a", "b")
    trees = {s: DraftTree([11, 12, 13], [-1, 0, 1]) for s in "ab"}
    for r in range(8):
        bases = {s: len(plain.tokens[s]) for s in "ab"}
        plain.round(trees)
        following = {s: DraftTree([(20 + r + k) % 256 for k in range(3)], [-1, 0, 1]) for s in "ab"}
        hints = []
        for s in "ab":
            outcome = plain.tokens[s][bases[s] :]
            others = [
                AheadTree([*outcome[:-1], (outcome[-1] + k) % 256], following[s]) for k in (1, 2)
            ]
            hints.append(NextTrees(s, bases[s], [*others, AheadTree(outcome, following[s])]))
        engine = chained.engine
        chained.round(trees, meanwhile=lambda engine=engine, hints=hints: engine.hint_next(hints))
        trees = following
    _same(plain, chained, _room(chained))
    assert chained.engine.num_next_used == 7
    # the begin round and 8 rounds: 9 tokens each with nothing accepted; the rates took more
    assert all(len(plain.tokens[s]) > len(PROMPTS[s]) + 9 for s in "ab")
    _release(plain, chained)


def test_resolve_gives_each_chained_round_the_inputs_the_gateway_sends() -> None:
    """A sequence whose outcome is the hint's outcome placed on the device gets that round; one
    whose outcome is not among the hint's, or is another path of the same length and bonus
    than the one placed (the first with them), gets none."""
    tree = DraftTree([4, 5], [-1, 0])
    hints = [
        NextTrees("a", 10, [AheadTree([9, 2], tree)]),
        NextTrees("b", 3, [AheadTree([1], tree)]),
        NextTrees("c", 3, [AheadTree([6, 2], tree), AheadTree([9, 2], tree)]),
    ]
    chained = [VerifyInput(s, False, 0, [0], DraftTree([0, 0], [-1, 0])) for s in "abc"]
    found = resolve(chained, hints, [([9], 2, 11), ([], 8, 3), ([9], 2, 4)])
    assert found == [True, False, False]
    assert (chained[0].kv_committed_len, chained[0].pending_tokens, chained[0].tree) == (
        11,
        [2],
        tree,
    )
    assert chained[1].kv_committed_len == chained[2].kv_committed_len == -1  # never taken
    # misses run plain: "b" (no outcome with its length and bonus) was placed as the plain
    # round; "c" was placed on [6, 2] (its first with one accepted and bonus 2), not plain
    for hint in hints:
        hint.plain = True
    chained = [VerifyInput(s, False, 0, [0], DraftTree([0, 0], [-1, 0])) for s in "abc"]
    found = resolve(chained, hints, [([9], 2, 11), ([], 8, 3), ([9], 2, 4)])
    assert found == [True, True, False]
    assert (chained[1].kv_committed_len, chained[1].pending_tokens, chained[1].tree) == (
        3,
        [8],
        DraftTree(),
    )
    assert chained[2].kv_committed_len == -1


def test_rounds_of_more_sequences_than_the_max_batch_are_not_chained(
    target_dir: Path, device: str
) -> None:
    """--chain-max-batch: a hint for a round of more sequences waits for the round's answer (as
    without chaining); the same tokens."""
    PHASES.clear()
    plain, late, was_chained = _run(target_dir, device, rounds=3, chain_max_batch=1)
    assert was_chained == [False] * 3 and PHASES == ["finish"] * 3
    _same(plain, late, _room(late))
    _release(plain, late)


@pytest.mark.parametrize("asked", [None, "on", "off"])
def test_chained_rounds_are_auto_unless_asked_and_up_passes_the_flags_to_the_verifier(
    asked: str | None,
) -> None:
    """--chain-rounds (auto by default, for rounds of one sequence: --chain-max-batch) goes
    from `up` to the verifier's command line."""
    from specsplit import cli, up

    extra = [] if asked is None else ["--chain-rounds", asked, "--chain-max-batch", "4"]
    extra += [] if asked is None else ["--chain-min-guess-rate", "0.5"]
    commands = up.child_commands(cli.parse_args(["up", *extra]))
    child = cli.parse_args(commands["verifier"][3:])  # after python -m specsplit.cli
    assert child.chain_rounds == (asked or "auto")
    assert child.chain_max_batch == (1 if asked is None else 4)
    assert child.chain_min_guess_rate == (CHAIN_MIN_GUESS_RATE if asked is None else 0.5)


@pytest.mark.parametrize("guessed", [("a", "b"), ()], ids=["guessed", "missed"])
def test_rounds_chain_only_while_the_hints_guess_their_outcomes(
    target_dir: Path, device: str, guessed: tuple[str, ...]
) -> None:
    """--chain-min-guess-rate: a chained round whose outcome the hint missed is dropped after
    the device ran it, so the engine chains only once the last rounds' hints (GUESS_MIN_ROUNDS
    sequence rounds, 2 a round here) had their outcomes at that rate, and never while they miss
    them; the rounds not chained launch once the answer went out, as before. The same tokens
    either way."""
    rounds = 8
    plain, chained, was_chained = _run(
        target_dir, device, rounds=rounds, guessed=guessed, chain_min_guess_rate=0.9
    )
    first = GUESS_MIN_ROUNDS // 2  # rounds whose hints count before the rate is known
    if guessed:
        assert was_chained == [False] * first + [True] * (rounds - first)
        assert chained.engine.hints.guess_rate() == 1.0
    else:
        assert was_chained == [False] * rounds
        assert chained.engine.hints.guess_rate() == 0.0
    _same(plain, chained, _room(chained))
    _release(plain, chained)


def _gate(device_ns: int, chain_ns: int) -> ChainGate:
    """An auto gate that has measured rounds of `device_ns` and chains of `chain_ns`."""
    gate = ChainGate(auto=True)
    for _ in range(CHAIN_WINDOW):
        gate.round_ran(device_ns)
        gate.chained(chain_ns)
    return gate


@pytest.mark.parametrize("pays", [True, False], ids=["long-rounds", "short-rounds"])
def test_auto_chains_only_where_a_round_outlasts_the_chains_host_work(
    target_dir: Path, device: str, pays: bool
) -> None:
    """--chain-rounds auto (ChainGate): with rounds measured far longer on the device than a
    chain's host work every hint for a round in flight chains; with rounds shorter than it none
    does (they launch once the answer went out). The same tokens either way."""
    rounds = 6
    gate = _gate(device_ns=10**12 if pays else 1, chain_ns=10**6)
    plain, chained, was_chained = _run(target_dir, device, rounds=rounds, chain_gate=gate)
    assert was_chained == [pays] * rounds
    _same(plain, chained, _room(chained))
    _release(plain, chained)


def test_the_chain_gate_measures_first_then_compares_and_probes_now_and_then() -> None:
    """ChainGate: `auto` off chains always; on, it chains until CHAIN_MIN_SAMPLES chains and
    rounds are measured (a round of 0 ns, off a GPU, counts nothing), then while the rounds'
    median device time is at least CHAIN_PAYS_MARGIN times the chains' median host work, and
    otherwise on one hint in CHAIN_PROBE_EVERY only."""
    assert ChainGate(auto=False).pays()
    gate = ChainGate(auto=True)
    for _ in range(CHAIN_MIN_SAMPLES):
        gate.round_ran(0)
        gate.chained(10**6)
    assert gate.pays() and not gate.device_ns  # no device time measured yet
    for _ in range(CHAIN_MIN_SAMPLES):
        gate.round_ran(int(CHAIN_PAYS_MARGIN * 10**6))
    assert gate.pays()  # exactly at the margin
    for _ in range(CHAIN_WINDOW):
        gate.round_ran(int(CHAIN_PAYS_MARGIN * 10**6) - 1)
    choices = [gate.pays() for _ in range(2 * CHAIN_PROBE_EVERY)]
    probes = [i for i, chain in enumerate(choices) if chain]
    assert probes == [CHAIN_PROBE_EVERY - 1, 2 * CHAIN_PROBE_EVERY - 1]
    gate.chained(10**3)  # the probe's chain, far cheaper: the median moves only with the window
    assert not gate.pays()
    for _ in range(CHAIN_WINDOW // 2 + 1):
        gate.chained(10**3)
    assert gate.pays()


def test_the_guess_rate_counts_each_hint_for_the_round_it_names() -> None:
    """HintBook.guess_rate: over the last GUESS_WINDOW sequence rounds finished with a hint for
    them, whether the outcome was among the hint's; a hint for another round counts nothing;
    unknown (None) before GUESS_MIN_ROUNDS."""
    book = HintBook()
    tree = DraftTree([4], [-1])
    rounds = [VerifyInput(s, False, 10, [1], DraftTree([5, 6], [-1, 0])) for s in "ab"]
    # "a" accepted [5] and drew 9 (its hint guessed it); "b" drew 8 after nothing (missed)
    outputs = [VerifyOutput("a", [5], 9, 12), VerifyOutput("b", [], 8, 11)]
    for _ in range(GUESS_MIN_ROUNDS // 2):
        assert book.guess_rate() is None
        book.store(
            [
                NextTrees("a", 11, [AheadTree([5, 9], tree)]),
                NextTrees("b", 11, [AheadTree([5, 8], tree)]),
            ],
            {"a", "b"},
        )
        book.round_finished(rounds, outputs)
        book.next.clear()
    assert book.guess_rate() == 0.5
    book.store([NextTrees("b", 99, [AheadTree([8], tree)])], {"b"})  # another round's
    book.round_finished(rounds[1:], outputs[1:])
    assert len(book.guessed) == GUESS_MIN_ROUNDS
    for _ in range(GUESS_WINDOW):
        book.store([NextTrees("a", 11, [AheadTree([5, 9], tree)])], {"a"})
        book.round_finished(rounds[:1], outputs[:1])
    assert book.guess_rate() == 1.0  # the window holds the last GUESS_WINDOW only
    for _ in range(GUESS_WINDOW):  # a miss the hint runs plain: its next round was named
        book.store([NextTrees("b", 11, [AheadTree([5, 8], tree)], plain=True)], {"b"})
        book.round_finished(rounds[1:], outputs[1:])
    assert book.guess_rate() == 1.0


def test_the_devices_idle_time_before_a_round_comes_from_its_timestamps(
    target_dir: Path, device: str
) -> None:
    """`on_idle` (specsplit_verifier_idle_seconds): on a GPU each round after the first of the
    same sequences reports the device's idle time before it, from the two rounds' CUDA events;
    on the CPU there are no device timestamps and nothing is reported."""
    driver = Driver(_engine(target_dir, False, device))
    idles: list[float] = []
    driver.engine.on_idle = idles.append
    driver.begin("a", "b")
    driver.decode("a", "b", rounds=3)
    if device == "cpu":
        assert idles == []
    else:
        assert len(idles) == 3 and all(0.0 <= seconds < 5.0 for seconds in idles)
    _release(driver)
