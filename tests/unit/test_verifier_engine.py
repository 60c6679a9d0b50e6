"""Verifier engine: tree verification, accepted-path KV commit, and refusals that change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specsplit.errors import Code, ServiceError
from specsplit.messages import VerifyInput
from specsplit.model.llama import make_kv_cache
from specsplit.model.loader import load_model
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.support import TINY_VOCAB, save_tiny_llama
from verifier.engine import VerifierEngine
from verifier.engine_setup import check_kv_dtype

PROMPT = [5, 17, 99, 3, 250, 41, 8]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("verifier") / "target", seed=11)


def _engine(target_dir: Path, page_size: int = 4, num_pages: int = 64) -> VerifierEngine:
    model, config = load_model(str(target_dir), dtype=torch.float64, device="cpu")
    kv = make_kv_cache(config, num_pages, page_size, torch.float64, "cpu")
    return VerifierEngine(model, kv, config.max_position_embeddings, config.vocab_size)


def _greedy_continuation(engine: VerifierEngine, prompt: list[int], n: int) -> list[int]:
    """n greedy target tokens via plain one-token rounds (then releases the sequence)."""
    out = engine.verify([VerifyInput("ref", True, 0, prompt, DraftTree())])[0]
    tokens = [out.bonus_token]
    while len(tokens) < n:
        out = engine.verify(
            [VerifyInput("ref", False, out.kv_committed_len, [tokens[-1]], DraftTree())]
        )[0]
        tokens.append(out.bonus_token)
    engine.release(["ref"])
    return tokens


def _kv_rows(engine: VerifierEngine, seq_id: str, length: int) -> torch.Tensor:
    slots = engine.seqs[seq_id].kv.slots(0, length)
    return torch.stack(
        [torch.stack([k[slots], v[slots]]) for k, v in zip(engine.kv.k, engine.kv.v, strict=True)]
    )


def test_deep_branch_in_topk_tree_commits_contiguous_kv(target_dir: Path) -> None:
    engine = _engine(target_dir)
    g = _greedy_continuation(engine, PROMPT, 4)  # g[0] = bonus after the prompt
    wrong = [(t + 1) % TINY_VOCAB for t in g]
    # root -> {wrong0, g1}; g1 -> {wrong2, g2}; g2 -> {g3}; plus a decoy under wrong0
    tree = DraftTree(
        tokens=[wrong[1], g[1], wrong[2], wrong[2], g[2], g[3]],
        parents=[-1, -1, 0, 1, 1, 4],
    )
    first = engine.verify([VerifyInput("s", True, 0, PROMPT, DraftTree())])[0]
    assert first.bonus_token == g[0]
    out = engine.verify([VerifyInput("s", False, len(PROMPT), [g[0]], tree)])[0]
    assert out.accepted_tokens == [g[1], g[2], g[3]]
    assert out.num_accepted_tokens == 4
    assert out.kv_committed_len == len(PROMPT) + 1 + 3

    # the committed KV equals what a plain prefill of the same tokens writes
    tokens = PROMPT + [g[0], g[1], g[2], g[3]]
    engine.verify([VerifyInput("plain", True, 0, tokens, DraftTree())])
    assert torch.allclose(
        _kv_rows(engine, "s", len(tokens)), _kv_rows(engine, "plain", len(tokens)), atol=1e-10
    )
    engine.release(["s", "plain"])
    assert engine.num_pages_used == 0
    engine.check_integrity()


def test_bonus_token_continues_exactly_after_partial_acceptance(target_dir: Path) -> None:
    engine = _engine(target_dir, page_size=1)
    g = _greedy_continuation(engine, PROMPT, 5)
    engine.verify([VerifyInput("s", True, 0, PROMPT, DraftTree())])
    tree = DraftTree(tokens=[g[1], (g[2] + 1) % TINY_VOCAB], parents=[-1, 0])
    out = engine.verify([VerifyInput("s", False, len(PROMPT), [g[0]], tree)])[0]
    assert out.accepted_tokens == [g[1]] and out.bonus_token == g[2]
    out = engine.verify(
        [VerifyInput("s", False, out.kv_committed_len, [g[2]], DraftTree([g[3], g[4]], [-1, 0]))]
    )[0]
    assert out.accepted_tokens == [g[3], g[4]]
    engine.release(["s"])
    assert engine.num_pages_used == 0


def _bad_inputs() -> list[tuple[str, VerifyInput, Code, str]]:
    ok_tree = DraftTree([1, 2], [-1, 0])
    return [
        ("unknown_seq_id", VerifyInput("nope", False, 0, [1], ok_tree), Code.NOT_FOUND, "nope"),
        (
            "kv_committed_len_mismatch",
            VerifyInput("live", False, 3, [1], ok_tree),
            Code.INVALID_ARGUMENT,
            "kv_committed_len",
        ),
        (
            "parent_out_of_range",
            VerifyInput("live", False, len(PROMPT), [1], DraftTree([1, 2], [-1, 5])),
            Code.INVALID_ARGUMENT,
            "tree.parents[1]",
        ),
        (
            "parent_not_earlier",
            VerifyInput("live", False, len(PROMPT), [1], DraftTree([1, 2], [1, -1])),
            Code.INVALID_ARGUMENT,
            "tree.parents[0]",
        ),
        (
            "repeated_sibling",
            VerifyInput("live", False, len(PROMPT), [1], DraftTree([1, 1], [-1, -1])),
            Code.INVALID_ARGUMENT,
            "repeats a sibling",
        ),
        (
            "negative_token",
            VerifyInput("live", False, len(PROMPT), [1], DraftTree([1, -3], [-1, 0])),
            Code.INVALID_ARGUMENT,
            "tree.tokens[1]",
        ),
        (
            "token_outside_vocab",
            VerifyInput("live", False, len(PROMPT), [1], DraftTree([TINY_VOCAB], [-1])),
            Code.INVALID_ARGUMENT,
            "tree.tokens[0]",
        ),
        (
            "empty_pending",
            VerifyInput("live", False, len(PROMPT), [], ok_tree),
            Code.INVALID_ARGUMENT,
            "pending_tokens",
        ),
        (
            "negative_temperature",
            VerifyInput("live", False, len(PROMPT), [1], ok_tree, SamplingParams(temperature=-1.0)),
            Code.INVALID_ARGUMENT,
            "temperature",
        ),
        (
            "top_p_zero",
            VerifyInput(
                "live", False, len(PROMPT), [1], ok_tree, SamplingParams(temperature=1.0, top_p=0.0)
            ),
            Code.INVALID_ARGUMENT,
            "top_p",
        ),
        (
            "begin_on_existing",
            VerifyInput("live", True, 0, [1], ok_tree),
            Code.INVALID_ARGUMENT,
            "begin",
        ),
        (
            "past_context",
            VerifyInput("fresh", True, 0, [1] * 600, DraftTree()),
            Code.INVALID_ARGUMENT,
            "context",
        ),
    ]


@pytest.mark.parametrize(
    ("case", "bad", "code", "names"), _bad_inputs(), ids=[c[0] for c in _bad_inputs()]
)
def test_bad_round_is_refused_and_changes_nothing(
    target_dir: Path, case: str, bad: VerifyInput, code: Code, names: str
) -> None:
    engine = _engine(target_dir)
    engine.verify([VerifyInput("live", True, 0, PROMPT, DraftTree())])
    pages, committed = engine.num_pages_used, engine.seqs["live"].kv.kv_committed_len
    # the bad sequence rides along with a good new one: the whole round is refused
    good = VerifyInput("other", True, 0, [4, 5, 6], DraftTree())
    with pytest.raises(ServiceError) as err:
        engine.verify([good, bad])
    assert err.value.code == code
    assert names in err.value.message
    assert set(engine.seqs) == {"live"}
    assert engine.num_pages_used == pages
    assert engine.seqs["live"].kv.kv_committed_len == committed
    engine.check_integrity()
    engine.release(["live"])
    assert engine.num_pages_used == 0


def test_kv_full_is_resource_exhausted_and_changes_nothing(target_dir: Path) -> None:
    engine = _engine(target_dir, page_size=4, num_pages=3)
    with pytest.raises(ServiceError) as err:
        engine.verify([VerifyInput("a", True, 0, list(range(3, 20)), DraftTree())])
    assert err.value.code == Code.RESOURCE_EXHAUSTED
    assert not engine.seqs and engine.num_pages_used == 0


def test_hidden_states_cover_pending_tokens_and_accepted_path(target_dir: Path) -> None:
    engine = _engine(target_dir)
    g = _greedy_continuation(engine, PROMPT, 3)
    layers = (0, 1)
    first = engine.verify(
        [VerifyInput("s", True, 0, PROMPT, DraftTree(), hidden_state_layers=layers)]
    )[0]
    assert first.hidden_states is not None
    assert first.hidden_states.dtype == torch.bfloat16
    assert tuple(first.hidden_states.shape) == (len(PROMPT), 2 * 64)  # [pending, layers * hidden]
    tree = DraftTree([(g[1] + 1) % TINY_VOCAB, g[1], g[2]], [-1, -1, 1])
    out = engine.verify(
        [VerifyInput("s", False, len(PROMPT), [g[0]], tree, hidden_state_layers=layers)]
    )[0]
    assert out.accepted_tokens == [g[1], g[2]]
    assert out.hidden_states is not None and out.hidden_states.shape[0] == 1 + 2
    # the rows equal a plain prefill's hidden states for the same tokens
    tokens = PROMPT + g[:3]
    plain = engine.verify(
        [VerifyInput("p", True, 0, tokens, DraftTree(), hidden_state_layers=layers)]
    )[0]
    assert plain.hidden_states is not None
    assert torch.allclose(
        out.hidden_states.double(), plain.hidden_states[len(PROMPT) :].double(), atol=1e-2
    )
    engine.release(["s", "p"])
    assert engine.num_pages_used == 0


def test_a_round_returns_hidden_states_only_to_the_sequences_that_ask(target_dir: Path) -> None:
    """A batch mixes sequences that read no hidden states (speculation off) with ones for an
    EAGLE drafter: the askers get theirs, as if alone; the others none. Two different layer
    sets in one round are refused."""
    engine = _engine(target_dir)
    layers = (0, 1)
    other = [(t + 5) % TINY_VOCAB for t in PROMPT]
    mixed = engine.verify(
        [
            VerifyInput("plain", True, 0, other, DraftTree()),
            VerifyInput("asks", True, 0, PROMPT, DraftTree(), hidden_state_layers=layers),
        ]
    )
    alone = engine.verify(
        [VerifyInput("alone", True, 0, PROMPT, DraftTree(), hidden_state_layers=layers)]
    )[0]
    assert mixed[0].hidden_states is None
    assert mixed[1].hidden_states is not None and alone.hidden_states is not None
    assert mixed[1].hidden_states.shape == (len(PROMPT), 2 * 64)
    assert torch.allclose(mixed[1].hidden_states.double(), alone.hidden_states.double(), atol=1e-2)
    with pytest.raises(ServiceError) as err:
        engine.verify(
            [
                VerifyInput("x", True, 0, PROMPT, DraftTree(), hidden_state_layers=(0,)),
                VerifyInput("y", True, 0, PROMPT, DraftTree(), hidden_state_layers=(1,)),
            ]
        )
    assert err.value.code == Code.INVALID_ARGUMENT and "hidden_state_layers" in err.value.message
    engine.release(["plain", "asks", "alone"])
    assert engine.num_pages_used == 0


def test_prefill_with_hidden_states_computes_logits_only_at_the_root_and_nodes(
    target_dir: Path,
) -> None:
    """Hidden states of every pending token, logits only where acceptance reads them: a
    prefill for an EAGLE drafter does not compute the whole prompt's logits."""
    engine = _engine(target_dir)
    seen: list[tuple[int, int]] = []
    forward = engine.model.forward

    def recording(batch, kv, aux_layers=()):
        out = forward(batch, kv, aux_layers=aux_layers)
        assert out.hidden_states is not None
        seen.append((out.logits.shape[0], out.hidden_states.shape[0]))
        return out

    engine.model.forward = recording  # type: ignore[method-assign]
    tree = DraftTree([3, 4, 5], [-1, 0, -1])
    out = engine.verify([VerifyInput("s", True, 0, PROMPT, tree, hidden_state_layers=(0, 2))])
    assert seen == [(1 + len(tree), len(PROMPT) + len(tree))]
    hidden = out[0].hidden_states
    assert hidden is not None
    assert hidden.shape == (len(PROMPT) + len(out[0].accepted_tokens), 2 * 64)
    engine.release(["s"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(("rate", "expected_drafts"), [(1.0, 3), (0.0, 0)])
def test_synthetic_acceptance_accepts_first_children_at_the_rate(
    target_dir: Path, rate: float, expected_drafts: int, temperature: float
) -> None:
    """The benchmark-only mode: acceptance by rate (labelled not lossless), greedy and sampled
    sequences alike, the bonus token never a rejected draft, the K/V and lengths kept
    consistent, nothing leaked."""
    engine = VerifierEngine.load(  # as `serve-verifier --synthetic-acceptance` loads it
        str(target_dir),
        dtype=torch.float64,
        num_pages=64,
        page_size=4,
        synthetic_acceptance=(rate,),
    )
    sampling = SamplingParams(temperature=temperature, seed=3)
    out = engine.verify([VerifyInput("s", True, 0, PROMPT, DraftTree(), sampling)])[0]
    for _ in range(3):
        tree = DraftTree([7, 8, 9, 10], [-1, 0, 1, -1])  # a chain of 3 and a second root child
        out = engine.verify(
            [VerifyInput("s", False, out.kv_committed_len, [out.bonus_token], tree, sampling)]
        )[0]
        assert out.accepted_tokens == [7, 8, 9][:expected_drafts]
        if expected_drafts == 0:
            assert out.bonus_token not in (7, 10)  # both root children rejected
        engine.check_integrity()
    engine.release(["s"])
    assert engine.num_pages_used == 0


def test_a_float16_kv_cache_keeps_speculative_rounds_equal_to_plain_ones(target_dir: Path) -> None:
    """`kv_dtype=float16` under a float32 model on the CPU (the C layer's float16 cache): the
    pool holds float16, and a verified chain of the greedy continuation is accepted whole with
    the same bonus token: speculative rounds give what plain rounds over that cache give."""
    model, _ = load_model(str(target_dir), dtype=torch.float32, device="cpu")
    engine = VerifierEngine.for_model(model, num_pages=64, page_size=4, kv_dtype=torch.float16)
    assert engine.kv.data.dtype == torch.float16
    g = _greedy_continuation(engine, PROMPT, 6)
    engine.verify([VerifyInput("s", True, 0, PROMPT, DraftTree())])
    chain = DraftTree(tokens=g[1:5], parents=[-1, 0, 1, 2])
    out = engine.verify([VerifyInput("s", False, len(PROMPT), [g[0]], chain)])[0]
    assert out.accepted_tokens == g[1:5] and out.bonus_token == g[5]
    engine.release(["s"])
    assert engine.num_pages_used == 0


@pytest.mark.parametrize(
    ("kv_dtype", "model_dtype", "device"),
    [
        (torch.float16, torch.bfloat16, "cpu"),
        (torch.float16, torch.float32, "cuda"),
        (torch.bfloat16, torch.float32, "cpu"),
    ],
)
def test_a_kv_dtype_no_path_reads_is_refused(
    kv_dtype: torch.dtype, model_dtype: torch.dtype, device: str
) -> None:
    with pytest.raises(ValueError, match="KV cache"):
        check_kv_dtype(kv_dtype, model_dtype, torch.device(device))
    assert check_kv_dtype(None, model_dtype, torch.device(device)) == model_dtype
