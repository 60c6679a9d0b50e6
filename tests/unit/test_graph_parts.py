"""A round launched in parts (verifier `_graph_groups`, `graph_parts`): on a GPU a few long runs
of new tokens (newcomers' prefills, resumed sequences) beside many short ones, or more long
ones than a prefill graph holds, would take the whole round off the CUDA graphs, so each part
replays its own. Which split the graphs' sizes
give, and, on the CPU with the split forced, a round in parts answers exactly as one launch:
tokens, committed KV lengths, hidden-state rows, seeded sampling, and no page held after."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from specsplit.kv_cache import KVCache, SeqKV
from specsplit.messages import VerifyInput, VerifyOutput
from specsplit.model.batch import ForwardBatch, ForwardOutput
from specsplit.model.cuda_graphs import CudaGraphRunner, graph_parts
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.sampling import SamplingParams
from specsplit.step import build_forward_batch, causal_step
from specsplit.tree import DraftTree
from tests.support import TINY_VOCAB, save_tiny_llama
from tests.unit import test_decode_ahead as ahead_tests
from tests.unit.test_decode_ahead import _both, _release, _same
from tests.unit.test_verify_pipelined import _same as _same_outputs
from verifier.ahead_depth import MAX_DEPTH
from verifier.engine import VerifierEngine
from verifier.lead_in import lead_len, lead_waves, led_in
from verifier.rounds import Launched

# the verifier's captures at --graph-max-batch 64: decode and verify q's for every bucket, the
# prefill q's for at most 4 sequences (verifier/warmup.py)
SERVED = {q: [1, 2, 4, 8, 16, 32, 48, 64] for q in (1, 4, 5, 9, 17)} | {
    q: [1, 2, 4] for q in (32, 64, 128)
}


@pytest.mark.parametrize(
    ("news", "parts"),
    [
        ([5] * 8, [list(range(8))]),  # trees alike: one replay
        ([40, 1, 1], [[0, 1, 2]]),  # a prefill among few: a prefill graph holds them all
        ([5] * 6 + [40], [list(range(6)), [6]]),  # a newcomer beside trees
        ([1, 70, 1, 1, 1, 90, 1], [[0, 2, 3, 4, 6], [1, 5]]),  # two beside decode steps
        ([5] * 6 + [40] * 5, [list(range(6)), [6, 7, 8, 9], [10]]),  # five prefills: 4 + 1
        ([36] * 10, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]),  # resumed sequences: runs alike
        ([36] * 17, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [16]]),
        ([36] * 33, [list(range(33))]),  # past eight parts: eager
        ([5] * 6 + [40] * 29, [list(range(35))]),  # the trees and eight parts of prefills
        ([5] * 6 + [300], [list(range(7))]),  # past the longest prefill graph
        ([5] * 70, [list(range(64)), list(range(64, 70))]),  # past the largest bucket
        ([], [[]]),
    ],
)
def test_graph_parts_split_only_where_each_part_replays_and_eight_at_most(
    news: list[int], parts: list[list[int]]
) -> None:
    assert graph_parts(news, SERVED) == parts
    assert graph_parts(news, SERVED, pays=lambda _: True) == parts


def test_graph_parts_launch_once_where_the_parts_do_not_pay() -> None:
    seen: list[list[list[int]]] = []

    def never(parts: list[list[int]]) -> bool:
        seen.append(parts)
        return False

    assert graph_parts([5] * 6 + [40], SERVED, pays=never) == [list(range(7))]
    assert seen == [[[5] * 6, [40]]]  # each part's runs weighed
    assert graph_parts([5] * 8, SERVED, pays=never) == [list(range(8))]  # one graph: not asked
    assert len(seen) == 1


def _no_forward(*_: object) -> ForwardOutput:
    raise AssertionError("nothing runs: the timings alone")


def _runner(replay_ms: dict[tuple[int, int], float], eager: float | None) -> CudaGraphRunner:
    """A runner's timings as a GPU's warm-up sets them (nothing captured: no GPU here)."""
    kv = KVCache(1, 1, 4, num_pages=4, page_size=4, dtype=torch.float32, device="cpu")
    runner = CudaGraphRunner(_no_forward, kv, max_context=64)
    runner.q_sizes = dict(SERVED)
    runner.replay_ms = replay_ms
    runner.eager_round_ms, runner.part_host_ms = eager, 0.5
    return runner


def _timings(weights_ms: float, token_ms: float) -> dict[tuple[int, int], float]:
    """Each served graph's replay: the weights read once, or its padded tokens' compute."""
    return {(q, b): max(weights_ms, q * b * token_ms) for q, sizes in SERVED.items() for b in sizes}


@pytest.mark.parametrize(
    ("replays", "eager", "news", "pays"),
    [
        # SmolLM2 on an H200: replays ~0.3 ms, an eager round ~20 ms of host time: parts pay,
        # eight of them too
        (_timings(0.3, 0.002), 20.0, [5] * 16 + [40], True),
        (_timings(0.3, 0.002), 20.0, [33] * 32, True),
        # an 8B-shaped target: a newcomer beside 64 trees pays; sixteen resumed sequences of 33
        # tokens padded to graphs of 64 (4 parts of ~8 ms) cost more than one eager launch
        (_timings(3.4, 0.03), 22.0, [5] * 64 + [40], True),
        (_timings(3.4, 0.03), 22.0, [33] * 16, False),
        # the warm-up timed no rounds (tests, a CPU): parts whenever the graphs hold them
        (_timings(3.4, 0.03), None, [33] * 16, True),
    ],
    ids=["smollm2-newcomer", "smollm2-resume-8-parts", "8b-newcomer", "8b-resume", "untimed"],
)
def test_parts_pay_against_an_eager_round_by_the_timings(
    replays: dict[tuple[int, int], float], eager: float | None, news: list[int], pays: bool
) -> None:
    runner = _runner(replays, eager)
    parts = graph_parts(news, SERVED)
    assert len(parts) > 1
    assert runner.parts_pay([[news[i] for i in part] for part in parts]) is pays
    assert (graph_parts(news, SERVED, pays=runner.parts_pay) == parts) is pays


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("parts") / "target", seed=5)


def _thirds(inputs: list[VerifyInput], others: list[int], leads: dict[int, int]) -> list[list[int]]:
    """Three parts where there are three sequences (else two or one), the last ones first."""
    cut = -(-len(others) // 3)
    return [others[k : k + cut] for k in range(0, len(others), cut)][::-1]


def _engine(target_dir: Path, split: bool) -> VerifierEngine:
    model, config = load_model(str(target_dir), dtype=torch.float64, device="cpu")
    kv = make_kv_cache(config, 96, 4, torch.float64, "cpu")
    engine = VerifierEngine(model, kv, config.max_position_embeddings, config.vocab_size)
    if split:  # as graph_parts would on a GPU: in parts, the later ones first
        engine._graph_groups = _thirds  # type: ignore[method-assign]
    return engine


def _truth(target_dir: Path, prompt: list[int], n: int) -> list[int]:
    """The target's first n greedy tokens after `prompt`, one plain round each."""
    engine = _engine(target_dir, split=False)
    out = engine.verify([VerifyInput("t", True, 0, prompt, DraftTree())])[0]
    tokens = [out.bonus_token]
    while len(tokens) < n:
        item = VerifyInput("t", False, out.kv_committed_len, [tokens[-1]], DraftTree())
        out = engine.verify([item])[0]
        tokens.append(out.bonus_token)
    return tokens


def _tree(rng: random.Random, right: list[int]) -> DraftTree:
    """From the target's next greedy tokens `right`: a chain of 3 right ones, a right one
    and a wrong one, two branches (the right one second, two deep), or none (a decode step)."""
    wrong = [(t + 1 + rng.randrange(TINY_VOCAB - 4)) % TINY_VOCAB for t in right]
    kind = rng.randrange(4)
    if kind == 0:
        return DraftTree(tokens=right[:3], parents=[-1, 0, 1])
    if kind == 1:
        return DraftTree(tokens=[right[0], wrong[1], wrong[2]], parents=[-1, 0, 1])
    if kind == 2:
        return DraftTree(tokens=[wrong[0], right[0], wrong[1], right[1]], parents=[-1, -1, 0, 1])
    return DraftTree()


PROMPTS = {
    seq_id: [random.Random(i).randrange(3, TINY_VOCAB) for _ in range(9 + 5 * i)]
    for i, seq_id in enumerate("abcdefg")
}


@pytest.fixture(scope="module")
def truths(target_dir: Path) -> dict[str, list[int]]:
    return {seq_id: _truth(target_dir, prompt, 40) for seq_id, prompt in PROMPTS.items()}


JOINING = {0: "abc", 3: "d", 5: "e"}  # round: the sequences that begin in it


def _rounds(
    engine: VerifierEngine,
    truths: dict[str, list[int]],
    layers: tuple[int, ...],
    sampled: bool,
    joining: dict[int, str] = JOINING,
    first_trees: bool = False,
) -> list[VerifyOutput]:
    """Eight rounds as a gateway sends them, from one seed: sequences begin as `joining` says
    (by default three, then two more mid-way: a prefill beside the others' trees), and each
    round drafts a tree or a decode step per sequence (first_trees: a prompt's round too)."""
    rng = random.Random(0)
    tokens: dict[str, list[int]] = {}
    committed: dict[str, int] = {}
    outputs = []
    for r in range(8):
        joins = joining.get(r, "")
        for seq_id in joins:
            tokens[seq_id] = list(PROMPTS[seq_id])
            committed[seq_id] = 0
        inputs = []
        for i, seq_id in enumerate(tokens):
            sampling = SamplingParams(temperature=1.0, seed=i) if sampled else SamplingParams()
            generated = len(tokens[seq_id]) - len(PROMPTS[seq_id])
            right = truths[seq_id][generated : generated + 3]
            tree = DraftTree() if seq_id in joins and not first_trees else _tree(rng, right)
            item = VerifyInput(
                seq_id,
                seq_id in joins,
                committed[seq_id],
                tokens[seq_id][committed[seq_id] :],
                tree,
                sampling,
            )
            item.hidden_state_layers = layers
            inputs.append(item)
        for out in engine.verify(inputs):
            tokens[out.seq_id] += [*out.accepted_tokens, out.bonus_token]
            committed[out.seq_id] = out.kv_committed_len
            outputs.append(out)
    engine.release(list(tokens))
    assert engine.num_pages_used == 0
    engine.check_integrity()
    return outputs


@pytest.mark.parametrize("layers", [(), (0, 1)], ids=["", "hidden"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_round_in_two_parts_answers_as_one(
    target_dir: Path, truths: dict[str, list[int]], layers: tuple[int, ...], sampled: bool
) -> None:
    whole = _rounds(_engine(target_dir, split=False), truths, layers, sampled)
    parts = _rounds(_engine(target_dir, split=True), truths, layers, sampled)
    assert len(parts) == len(whole) == 3 * 8 + 5 + 3
    _same_outputs(parts, whole)
    assert all((out.hidden_states is not None) == bool(layers) for out in parts)
    accepted = [len(out.accepted_tokens) for out in whole]
    assert (max(accepted) == 3 and 1 in accepted) or sampled  # whole paths and cut ones


def test_the_verifier_counts_its_forwards_by_path(target_dir: Path) -> None:
    """`specsplit_verifier_forwards_total{path}`: a forward each part (on the CPU, eager), and
    `specsplit_verifier_eager_forwards_total{why}` beside it ("no graphs")."""
    from prometheus_client import REGISTRY

    def eager() -> tuple[float, float]:
        """Eager forwards, and those counted as run with no graphs captured (the CPU)."""
        path = "specsplit_verifier_forwards_total", {"path": "eager"}
        why = "specsplit_verifier_eager_forwards_total", {"why": "no graphs"}
        return REGISTRY.get_sample_value(*path) or 0.0, REGISTRY.get_sample_value(*why) or 0.0

    engine = _engine(target_dir, split=True)
    inputs = [VerifyInput(s, True, 0, PROMPTS[s], DraftTree()) for s in "abc"]
    before = eager()
    engine.verify(inputs)
    assert [n - b for n, b in zip(eager(), before, strict=True)] == [3, 3]  # the three parts
    engine.verify([VerifyInput("d", True, 0, PROMPTS["d"], DraftTree())])
    assert [n - b for n, b in zip(eager(), before, strict=True)] == [4, 4]
    engine.release(["a", "b", "c", "d"])


@pytest.mark.parametrize("depth", range(1, MAX_DEPTH + 1), ids=lambda d: f"depth{d}")
def test_newcomers_beside_a_step_run_ahead_launch_in_parts(
    target_dir: Path, depth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Newcomers whose prefills the graphs take in parts, beside the running sequence's decode
    step run ahead: the step is still taken, the newcomers launch in parts beside it, the steps
    queued behind it are dropped (their join takes the newcomers as one part) and the next
    step runs ahead for all; the tokens and committed K/V are an engine's without steps ahead
    or parts, and no page stays held."""
    monkeypatch.setitem(ahead_tests.PROMPTS, "c", [9, 40, 2, 77, 5])  # (the driver's prompts)
    monkeypatch.setitem(ahead_tests.PROMPTS, "d", [61, 3, 18])
    plain, ahead = _both(target_dir, "cpu", depth)
    engine = ahead.engine
    engine._graph_groups = _thirds  # type: ignore[method-assign]
    rounds: list[tuple[bool, int]] = []  # each launch's (a step taken, parts launched beside it)
    take, launch_new = engine._take_ahead, engine._launch_new

    def taking(inputs: list[VerifyInput]) -> tuple[Launched | None, list[int]]:
        taken, positions = take(inputs)
        rounds.append((taken is not None, 0))
        return taken, positions

    def launching(groups: list[list[VerifyInput]], leads: list[int]) -> list[Launched]:
        rounds[-1] = (rounds[-1][0], len(groups))
        return launch_new(groups, leads)

    engine._take_ahead = taking  # type: ignore[method-assign]
    engine._launch_new = launching  # type: ignore[method-assign]
    for driver in (plain, ahead):
        driver.begin("a")
        driver.decode("a", rounds=2)
        driver.round(dict.fromkeys("acd", DraftTree()), begin={"c", "d"})
        driver.decode("a", "c", "d", rounds=3)
    _same(plain, ahead)
    assert rounds[3] == (True, 2)  # "a"'s step taken, "c" and "d" in two parts beside it
    assert all(taken for taken, _ in rounds[1:]), rounds  # every round after the first
    # the steps queued behind the one taken (depth - 1 of them)
    assert engine.num_ahead_dropped_by == ({"other work": depth - 1} if depth > 1 else {})
    _release(plain, ahead)


@pytest.mark.parametrize("first_trees", [False, True], ids=["prompts", "prompts-with-trees"])
@pytest.mark.parametrize("layers", [(), (0, 1)], ids=["", "hidden"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_prompts_led_in_by_chunks_answer_as_one_round(
    target_dir: Path,
    truths: dict[str, list[int]],
    layers: tuple[int, ...],
    sampled: bool,
    first_trees: bool,
) -> None:
    """Prompts of 9-29 tokens led in ahead of their rounds in chunks of 8 (verifier/lead_in.py;
    on a GPU chunks of the largest prefill graph, each a replay) answer as rounds that take
    them whole: tokens, committed lengths, seeded sampling, every pending token's hidden-state
    row (the led-in ones first), and no page held after; in parts too."""
    whole = _rounds(_engine(target_dir, False), truths, layers, sampled, first_trees=first_trees)
    for split in (False, True):
        engine = _engine(target_dir, split)
        engine.lead_q = 8
        led: list[tuple[VerifyInput, int]] = []  # each item that led in, and its lead
        lead_in = engine._lead_in

        def counted(items, seqs, leads, lead_in=lead_in, led=led):  # type: ignore[no-untyped-def]
            led.extend((item, m) for item, m in zip(items, leads, strict=True) if m)
            return lead_in(items, seqs, leads)

        engine._lead_in = counted  # type: ignore[method-assign]
        got = _rounds(engine, truths, layers, sampled, first_trees=first_trees)
        _same_outputs(got, whole)
        # every prompt (9-29 tokens: the first round's three, "d"'s and "e"'s) led in, leaving
        # its round a chunk at most, its root always
        assert sorted(item.seq_id for item, _ in led) == list("abcde")
        for item, m in led:
            assert 0 < m < len(item.pending_tokens)
            assert len(item.pending_tokens) + len(item.tree) - m <= 8
        if not first_trees:  # whole chunks: 9 -> 8 + 1, 14 -> 8 + 6, 19 -> 16 + 3, 24 -> 16 + 8
            assert sorted(m for _, m in led) == [8, 8, 16, 16, 24]
    if layers:  # a prompt's round: a row for every prompt token, then the accepted path's
        rows = [out.hidden_states.shape[0] - len(out.accepted_tokens) for out in whole[:3]]  # type: ignore[union-attr]
        assert rows == [len(PROMPTS[s]) for s in "abc"]


def test_lead_in_lengths_and_waves() -> None:
    def item(p: int, n: int) -> VerifyInput:
        tree = DraftTree(list(range(n)), [-1, *range(n - 1)])
        return VerifyInput("s", True, 0, list(range(p)), tree)

    assert lead_len(item(128, 0), 128) == 0  # one chunk: none
    assert lead_len(item(129, 0), 128) == 128  # the root alone in the round
    assert lead_len(item(300, 3), 128) == 256  # 44 + 3 in the round
    assert lead_len(item(124, 4), 128) == 0
    assert lead_len(item(126, 4), 128) == 125  # a short chunk: the root and the tree left
    assert lead_len(item(2, 200), 128) == 0  # a tree past a chunk: nothing lets it fit
    # chunk by chunk, at most `most` sequences a forward
    assert lead_waves([256, 0, 128, 384, 128, 128], 128, 4) == [[0, 2, 3, 4], [5], [0, 3], [3]]
    assert lead_waves([0, 0], 128, 4) == []
    led = led_in(item(300, 3), 256)
    assert (led.begin, led.kv_committed_len, led.pending_tokens) == (
        False,
        256,
        list(range(256, 300)),
    )


def test_a_round_that_fails_after_its_lead_in_commits_none_of_it(target_dir: Path) -> None:
    """A resumed sequence's 30 pending tokens lead in (chunks of 8), then the round's launch
    fails: the sequence's committed length is as before the round, no page is lost, and the
    gateway's retry of the same round answers as an engine that never led in."""
    tokens = PROMPTS["c"][:10]
    resume = PROMPTS["g"][:30]

    def rounds(engine: VerifierEngine, fail: bool) -> VerifyOutput:
        first = engine.verify([VerifyInput("a", True, 0, tokens, DraftTree())])[0]
        item = VerifyInput(
            "a", False, first.kv_committed_len, [first.bonus_token, *resume], DraftTree()
        )
        if fail:
            launch = engine._launch

            def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
                raise RuntimeError("device lost")

            engine._launch = failing  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="device lost"):
                engine.verify([item])
            engine._launch = launch  # type: ignore[method-assign]
            assert engine.seqs["a"].kv.kv_committed_len == first.kv_committed_len
            engine.check_integrity()
        out = engine.verify([item])[0]
        engine.release(["a"])
        assert engine.num_pages_used == 0
        return out

    want = rounds(_engine(target_dir, split=False), fail=False)
    engine = _engine(target_dir, split=False)
    engine.lead_q = 8
    got = rounds(engine, fail=True)
    assert (got.bonus_token, got.kv_committed_len) == (want.bonus_token, want.kv_committed_len)


@pytest.mark.parametrize("depth", range(1, MAX_DEPTH + 1), ids=lambda d: f"depth{d}")
def test_a_long_prompt_beside_a_step_run_ahead_leads_in(
    target_dir: Path, depth: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newcomer's 21-token prompt led in (chunks of 8) beside the running sequence's decode
    step run ahead: the step is taken, the newcomer's round brings 5 tokens, and the tokens and
    committed K/V are an engine's that leads nothing in and runs nothing ahead."""
    monkeypatch.setitem(ahead_tests.PROMPTS, "c", PROMPTS["e"][:21])
    plain, ahead = _both(target_dir, "cpu", depth)
    ahead.engine.lead_q = 8
    leads: list[int] = []
    lead_in = ahead.engine._lead_in

    def counted(items, seqs, lens):  # type: ignore[no-untyped-def]
        leads.extend(lens)
        return lead_in(items, seqs, lens)

    ahead.engine._lead_in = counted  # type: ignore[method-assign]
    for driver in (plain, ahead):
        driver.begin("a")
        driver.decode("a", rounds=2)
        driver.round(dict.fromkeys("ac", DraftTree()), begin={"c"})
        driver.decode("a", "c", rounds=3)
    _same(plain, ahead)
    assert leads == [16]  # "c" alone: "a"'s step was taken
    assert ahead.engine.num_ahead_used >= 4
    _release(plain, ahead)


@pytest.mark.parametrize(
    ("replays", "eager", "leads"),
    [
        # SmolLM2 on an H200: four chunks of 128 (~0.5 ms each) beside the chains' replay
        # against a ~20 ms eager launch: the prompt leads in
        (_timings(0.3, 0.002), 20.0, 512),
        # an 8B-shaped target: each chunk reads the weights again (~4-5 ms a chunk): one eager
        # launch of the 856 tokens (~22 ms) costs less
        (_timings(3.4, 0.03), 22.0, 0),
    ],
    ids=["smollm2", "8b"],
)
def test_a_long_prompt_leads_in_where_the_timings_say_it_pays(
    target_dir: Path, replays: dict[tuple[int, int], float], eager: float, leads: int
) -> None:
    """A 600-token newcomer beside 64 chains of 3: led in by chunks of 128 where the warm-up's
    timings (`parts_pay`) say the chunks and the round's parts cost less than one eager
    launch, else not at all (no other sequence leads in either way)."""
    engine = _engine(target_dir, split=False)
    engine.graphs = _runner(replays, eager)
    chains = [
        VerifyInput(f"s{i}", False, 10, [5], DraftTree([1, 2, 3], [-1, 0, 1])) for i in range(64)
    ]
    newcomer = VerifyInput("new", True, 0, list(range(600)), DraftTree())
    assert engine._lead_lens([*chains, newcomer]) == [0] * 64 + [leads]
    # 36 resumed sequences of 200 tokens: what is left of them (72 each) needs nine parts of
    # the prefill graphs (four a replay), past MAX_PARTS: the round runs eagerly anyway, so
    # nothing leads in (nine cheap chunks would have, were the rest's eager launch not counted)
    resumed = [VerifyInput(f"r{i}", False, 10, list(range(200)), DraftTree()) for i in range(36)]
    assert engine._lead_lens(resumed) == [0] * 36
    engine.graphs = None


def test_why_no_captured_graph_runs_a_step() -> None:
    """`CudaGraphRunner.why_eager` (what the verifier counts its eager forwards by): too many
    sequences, a page table past the graphs', a run no captured q holds, device inputs that
    would need padding rows; "none" where a graph runs it."""
    kv = KVCache(1, 1, 4, num_pages=256, page_size=4, dtype=torch.float32, device="cpu")
    runner = CudaGraphRunner(_no_forward, kv, max_context=512)  # graphs' tables: 144 pages
    runner.q_sizes = dict(SERVED)
    seqs: list[SeqKV] = []

    def batch(*runs: tuple[int, int]) -> ForwardBatch:
        """A step of sequences each (committed, new tokens), the last one's pages freed."""
        for seq in seqs:
            kv.release(seq)
        seqs.clear()
        steps = []
        for committed, new in runs:
            seq = kv.new_seq()
            kv.reserve(seq, committed + new)
            seq.kv_committed_len = committed
            seqs.append(seq)
            steps.append(causal_step(seq, [5] * new, [new - 1]))
        return build_forward_batch(steps, kv.page_size)[0]

    assert runner.why_eager(batch((3, 4), (9, 4))) == "none"
    assert runner.why_eager(batch(*[(0, 1)] * 70)) == "batch"  # past the largest bucket, 64
    assert runner.why_eager(batch((0, 200))) == "run"  # past the largest q, 128
    assert runner.why_eager(batch((40, 60), *[(3, 4)] * 8)) == "run"  # q=64 holds at most 4
    assert runner.why_eager(batch((599, 1))) == "context"  # 150 pages
    assert runner.why_eager(batch((3, 1), (9, 4)), device_rows=True) == "rows"  # padded to q=4
    assert runner.why_eager(batch((3, 4), (9, 4)), device_rows=True) == "none"
    for seq in seqs:
        kv.release(seq)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_long_prompt_led_in_in_a_round_of_several_decode_steps(
    target_dir: Path, sampled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newcomer's 21-token prompt led in (chunks of 8) in a round of 3 decode steps beside a
    running sequence's: its further steps decode from the round's results as without the
    lead-in (seeded sampling too), and no page is left."""
    monkeypatch.setitem(ahead_tests.PROMPTS, "c", PROMPTS["e"][:21])
    sampling = SamplingParams(temperature=0.9, seed=4) if sampled else None
    plain, ahead = _both(target_dir, "cpu", 2)
    ahead.engine.lead_q = 8
    for driver in (plain, ahead):
        driver.begin("a")
        driver.round(
            dict.fromkeys("ac", DraftTree()), begin={"c"}, steps={"a": 3, "c": 3}, sampling=sampling
        )
        driver.round(dict.fromkeys("ac", DraftTree()), steps={"a": 2, "c": 2}, sampling=sampling)
    _same(plain, ahead)
    assert len(ahead.tokens["c"]) == 21 + 3 + 2
    _release(plain, ahead)
