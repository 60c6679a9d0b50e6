"""Log-probabilities of a round's new tokens (VerifyInput.logprobs): each token's is the target's
raw log-softmax at its place, as one forward over the whole sequence gives it, for every round
shape (prefill, tree with partial acceptance, several decode steps, sampled); asking for them
changes no token; only the asking sequences pay; the wire carries them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from specsplit.convert import (
    verify_request_from_proto,
    verify_request_to_proto,
    verify_response_from_proto,
    verify_response_to_proto,
)
from specsplit.errors import Code, ServiceError
from specsplit.messages import NO_LOGPROBS, TokenLogprobs, VerifyInput, VerifyOutput
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from tests.support import TINY_VOCAB, save_tiny_llama
from tests.unit.test_decode_ahead import _engine as engine_as_served
from verifier.engine import VerifierEngine
from verifier.round_logprobs import logprobs_reference

PROMPT = [5, 17, 99, 3, 250, 41, 8]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("logprobs") / "target", seed=23)


@pytest.fixture(scope="module")
def reference(target_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def device() -> str:
    """The engines' device (tests/gpu/test_verify_logprobs_gpu.py runs these tests on CUDA)."""
    return "cpu"


def _engine(target_dir: Path, device: str, page_size: int = 4) -> VerifierEngine:
    """float64 on the CPU; on a GPU float32 with CUDA graphs, as served; decode steps run ahead
    where a round allows it."""
    return engine_as_served(target_dir, True, device, page_size=page_size)


def _expected(
    reference: LlamaForCausalLM, tokens: list[int], start: int, width: int
) -> TokenLogprobs:
    """The log-probabilities of tokens[start:] (each at the row before it) from one forward of
    the whole sequence."""
    with torch.no_grad():
        logits = reference(torch.tensor([tokens])).logits[0]
    rows = list(range(start - 1, len(tokens) - 1))
    return logprobs_reference(logits, rows, tokens[start:], width)


def _assert_close(got: TokenLogprobs | None, want: TokenLogprobs, device: str) -> None:
    """Within the engine's logits' float32 (and on a GPU its float32 forward's) precision."""
    tolerance = 1e-5 if device == "cpu" else 1e-3
    assert got is not None
    assert len(got) == len(want)
    assert got.logprobs == pytest.approx(want.logprobs, abs=tolerance)
    assert got.top_ids == want.top_ids
    for row, expected in zip(got.top_logprobs, want.top_logprobs, strict=True):
        assert row == pytest.approx(expected, abs=tolerance)


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_round_logprobs_are_the_full_forwards(
    target_dir: Path, reference: LlamaForCausalLM, device: str, page_size: int
) -> None:
    engine = _engine(target_dir, device, page_size)
    first = engine.verify([VerifyInput("s", True, 0, PROMPT, DraftTree(), logprobs=3)])[0]
    tokens = [*PROMPT, first.bonus_token]
    _assert_close(first.logprobs, _expected(reference, tokens, len(PROMPT), 3), device)
    # the greedy token, then a wrong one; a decoy branch beside it (1 + 3 tokens: on a GPU the
    # round replays a graph)
    greedy = []
    for _ in range(2):
        with torch.no_grad():
            greedy.append(int(reference(torch.tensor([tokens + greedy])).logits[0, -1].argmax()))
    wrong = (greedy[1] + 1) % TINY_VOCAB
    tree = DraftTree(tokens=[(greedy[0] + 1) % TINY_VOCAB, greedy[0], wrong], parents=[-1, -1, 1])
    item = VerifyInput("s", False, len(PROMPT), [first.bonus_token], tree, logprobs=5)
    out = engine.verify([item])[0]
    assert out.accepted_tokens == greedy[:1]
    assert out.bonus_token == greedy[1]
    _assert_close(
        out.logprobs, _expected(reference, tokens + out.new_tokens, len(tokens), 5), device
    )
    engine.release(["s"])
    assert engine.num_pages_used == 0


def test_decode_steps_round_has_every_steps_logprobs(
    target_dir: Path, reference: LlamaForCausalLM, device: str
) -> None:
    engine = _engine(target_dir, device)
    first = engine.verify([VerifyInput("s", True, 0, PROMPT, DraftTree())])[0]
    assert first.logprobs is None  # not asked
    tokens = [*PROMPT, first.bonus_token]
    item = VerifyInput("s", False, len(PROMPT), [first.bonus_token], DraftTree())
    item.decode_steps, item.logprobs = 4, 2
    out = engine.verify([item])[0]
    assert len(out.new_tokens) == 4
    _assert_close(
        out.logprobs, _expected(reference, tokens + out.new_tokens, len(tokens), 2), device
    )
    engine.release(["s"])


def test_sampled_round_logprobs_are_the_raw_distribution(
    target_dir: Path, reference: LlamaForCausalLM, device: str
) -> None:
    """Temperature, top-k and top-p shape the draw, not the reported log-probabilities."""
    engine = _engine(target_dir, device)
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=5)
    first = engine.verify([VerifyInput("s", True, 0, PROMPT, DraftTree(), sampling, logprobs=0)])
    tokens = [*PROMPT, first[0].bonus_token]
    tree = DraftTree(tokens=[4, 9, 13], parents=[-1, 0, 1])
    item = VerifyInput("s", False, len(PROMPT), tokens[-1:], tree, sampling, logprobs=0)
    out = engine.verify([item])[0]
    want = _expected(reference, tokens + out.new_tokens, len(tokens), 0)
    _assert_close(out.logprobs, want, device)
    assert out.logprobs is not None and out.logprobs.top_ids == [[]] * len(out.new_tokens)
    engine.release(["s"])


def test_asking_changes_no_token_and_only_askers_get_them(target_dir: Path, device: str) -> None:
    """Two batches alike but for one sequence's ask: the same tokens, log-probabilities for
    that sequence alone, in the order of its new tokens."""
    runs = []
    for ask in (NO_LOGPROBS, 4):
        engine = _engine(target_dir, device)
        outs = engine.verify(
            [
                VerifyInput("a", True, 0, PROMPT, DraftTree(), logprobs=ask),
                VerifyInput("b", True, 0, PROMPT[:4], DraftTree()),
            ]
        )
        tree = DraftTree(tokens=[outs[0].bonus_token, 7], parents=[-1, 0])
        outs = engine.verify(
            [
                VerifyInput("a", False, len(PROMPT), [outs[0].bonus_token], tree, logprobs=ask),
                VerifyInput("b", False, 4, [outs[1].bonus_token], DraftTree()),
            ]
        )
        runs.append(outs)
        assert outs[1].logprobs is None
        engine.release(["a", "b"])
    plain, asked = runs
    assert [o.new_tokens for o in plain] == [o.new_tokens for o in asked]
    assert plain[0].logprobs is None
    assert asked[0].logprobs is not None and len(asked[0].logprobs) == len(asked[0].new_tokens)
    assert all(len(ids) == 4 for ids in asked[0].logprobs.top_ids)


@pytest.mark.parametrize("ask", [-2, 21])
def test_logprobs_out_of_range_refused(target_dir: Path, device: str, ask: int) -> None:
    engine = _engine(target_dir, device)
    with pytest.raises(ServiceError) as err:
        engine.verify([VerifyInput("s", True, 0, PROMPT, DraftTree(), logprobs=ask)])
    assert err.value.code == Code.INVALID_ARGUMENT
    assert engine.num_pages_used == 0 and not engine.seqs


def test_logprobs_cross_the_wire() -> None:
    inputs = [
        VerifyInput("a", False, 3, [4], DraftTree(), logprobs=2),
        VerifyInput("b", False, 5, [6], DraftTree()),
    ]
    back = verify_request_from_proto(verify_request_to_proto(inputs))
    assert [item.logprobs for item in back] == [2, NO_LOGPROBS]
    plain = verify_request_to_proto([inputs[1]])
    assert not plain.logprobs  # (an empty column when none asks)
    lp = TokenLogprobs([-0.5, -1.25], [[3, 4], [5, 6]], [[-0.25, -2.0], [-0.5, -3.0]])
    outputs = [
        VerifyOutput("a", [9], 10, 5, logprobs=lp),
        VerifyOutput("b", [], 11, 6),
    ]
    read = verify_response_from_proto(verify_response_to_proto(outputs, verify_ns=1))
    assert read[0].logprobs == lp
    assert read[1].logprobs is None
    none_asked = verify_response_to_proto([outputs[1]], verify_ns=1)
    assert not none_asked.num_logprobs and not none_asked.token_logprobs


def test_decode_steps_run_ahead_carry_the_askers_logprobs(
    target_dir: Path, reference: LlamaForCausalLM, device: str
) -> None:
    """A batch of decode rounds where one sequence asks: the next step still runs ahead for
    both and is taken, the asker's log-probabilities those of its tokens; then a round of the
    asker alone and one of the other alone take their part of the step run ahead."""
    engine = _engine(target_dir, device)
    prompts = {"a": PROMPT, "b": PROMPT[2:]}
    asks = {"a": 3, "b": NO_LOGPROBS}
    tokens = {s: list(p) for s, p in prompts.items()}
    committed = dict.fromkeys(prompts, 0)

    def round_of(seq_ids: list[str]) -> None:
        inputs = [
            VerifyInput(
                s, committed[s] == 0, committed[s], tokens[s][committed[s] :], DraftTree(),
                logprobs=asks[s],
            )
            for s in seq_ids
        ]  # fmt: skip
        for out in engine.verify(inputs):
            start = len(tokens[out.seq_id])
            tokens[out.seq_id] += out.new_tokens
            committed[out.seq_id] = out.kv_committed_len
            if asks[out.seq_id] == NO_LOGPROBS:
                assert out.logprobs is None
            else:
                want = _expected(reference, tokens[out.seq_id], start, asks[out.seq_id])
                _assert_close(out.logprobs, want, device)

    for _ in range(4):
        round_of(["a", "b"])
    assert engine.num_ahead_used >= 2
    used = engine.num_ahead_used
    round_of(["a"])  # (the step run ahead for both, taken for "a" alone)
    round_of(["a"])
    round_of(["b"])  # ("b"'s was dropped; its own round now)
    round_of(["a", "b"])
    assert engine.num_ahead_used > used
    engine.release(["a", "b"])
    assert engine.num_pages_used == 0
