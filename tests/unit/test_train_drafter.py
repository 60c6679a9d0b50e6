"""`specsplit train-drafter`: the training-time test computes what the drafter will draft, the
trained head loads in the drafter and stays lossless, training lowers the loss, and a stopped
run resumes where it stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from drafter.eagle import load_eagle3
from drafter.eagle_checkpoint import HEAD_WEIGHTS
from drafter.eagle_proposer import Eagle3Proposer
from drafter.train import TargetFeatures, learning_rate, ttt_loss
from drafter.train_data import Example, cut_at_eos, draft_vocabulary, drafting_mask, make_batches
from drafter.train_head import Eagle3Trainable
from drafter.types import DraftJob, DraftSeq
from gateway.request import GenerationRequest
from specsplit.cli import main as cli_main
from specsplit.messages import SamplingParams, SpecParams
from specsplit.model.loader import load_model
from tests.eagle_random import save_random_eagle3
from tests.support import generate_all, generated_ids, make_stack, save_tiny_llama

DRAFT_VOCAB = 300
DEPTH = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train")
    target = save_tiny_llama(root / "target", seed=1, num_layers=4)
    _, config = load_model(str(target), dtype=torch.float64, device="cpu")
    head = save_random_eagle3(root / "head", config, seed=5, draft_vocab_size=DRAFT_VOCAB)
    return {"target": target, "head": head}


@pytest.mark.parametrize("prefix_len", [2, 5, 9])
def test_ttt_step_k_drafts_what_the_proposer_drafts(tiny, prefix_len: int) -> None:
    """Greedy chain from the paged proposer == argmax of TTT step k at entry root + k."""
    head = load_eagle3(str(tiny["head"]), str(tiny["target"]), torch.float64, "cpu")
    proposer = Eagle3Proposer(head, head.make_kv_cache(num_pages=64, page_size=4))
    gen = torch.Generator().manual_seed(prefix_len)
    tokens = torch.randint(0, head.config.vocab_size, (prefix_len,), generator=gen).tolist()
    width = 3 * head.config.target_hidden_size
    features = torch.randn(prefix_len - 1, width, generator=gen, dtype=torch.float64)
    seq = DraftSeq("s", list(tokens))
    seq.state = proposer.new_state(seq)
    job = DraftJob(seq, SpecParams(DEPTH, 1, DEPTH), SamplingParams(), 0, features)
    (tree,) = proposer.propose([job])
    proposer.release(seq)
    assert len(tree.tokens) == DEPTH and tree.parents == [-1, 0, 1, 2]

    trainable = Eagle3Trainable.from_head(head)
    input_ids = torch.tensor([tokens + tree.tokens])  # truth = what was drafted
    padded = torch.cat([features, torch.zeros(DEPTH + 1, width, dtype=torch.float64)])[None]
    with torch.no_grad():
        outputs = trainable(input_ids, padded, DEPTH)
    root = prefix_len - 2
    drafted = [
        int(trainable.draft_ids[trainable.logits(out[0, root + k]).argmax()])
        for k, out in enumerate(outputs)
    ]
    assert drafted == tree.tokens


def test_saved_trainable_head_loads_identically(tiny, tmp_path: Path) -> None:
    head = load_eagle3(str(tiny["head"]), str(tiny["target"]), torch.float64, "cpu")
    trainable = Eagle3Trainable.from_head(head)
    again = load_eagle3(
        str(trainable.save(tmp_path / "h", torch.float64)),
        str(tiny["target"]),
        torch.float64,
        "cpu",
    )
    assert again.config == head.config
    for name, tensor in head.w.items():
        if name != "t2d":
            assert torch.equal(again.w[name], tensor), name


def test_drafting_mask_starts_at_the_prompts_last_token_and_needs_a_next_token() -> None:
    batch = make_batches([Example([5, 6, 7], [8, 9, 2], "train")], 64, 64, seed=None)[0]
    # tokens x0..x5 (prompt 3): entry i reads x_{i+1}, predicts x_{i+2}; roots r >= 1
    assert drafting_mask(batch, 0, 5).tolist() == [[False, True, True, True, False]]
    assert drafting_mask(batch, 2, 5).tolist() == [[False, False, False, True, False]]


def test_draft_vocabulary_keeps_the_most_frequent_answer_tokens() -> None:
    examples = [Example([1], [7, 7, 7, 3, 3, 9], "train"), Example([1], [3, 4], "train")]
    assert draft_vocabulary(examples, 2, vocab_size=10).tolist() == [3, 7]
    assert cut_at_eos([4, 2, 5], [2]) == [4, 2]
    assert cut_at_eos([4, 5], [2]) == [4, 5]


def test_learning_rate_warms_up_then_decays_to_a_tenth() -> None:
    assert learning_rate(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert learning_rate(9, 100, 1.0, 10) == pytest.approx(1.0)
    assert learning_rate(100, 100, 1.0, 10) == pytest.approx(0.1)


def test_a_few_steps_lower_the_loss(tiny) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny["target"]), dtype=torch.float32)
    head = load_eagle3(str(tiny["head"]), str(tiny["target"]), torch.float32, "cpu")
    trainable = Eagle3Trainable.from_head(head)
    target = TargetFeatures(hf, head.config.aux_layers)
    gen = torch.Generator().manual_seed(0)
    examples = [
        Example([1, 2, 3], torch.randint(0, 512, (20,), generator=gen).tolist(), "train")
        for _ in range(4)
    ]
    (batch,) = make_batches(examples, 4096, 64, seed=None)
    features, logits = target(batch)
    optimizer = torch.optim.AdamW(trainable.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        result = ttt_loss(trainable, batch, features, logits, num_steps=3, decay=0.8)
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        losses.append(result.loss.item())
    # each answer token is predicted once per step from a root at or after the prompt's end
    assert result.counts == [4 * 20, 4 * 19, 4 * 18]
    assert losses[-1] < 0.7 * losses[0], losses


def test_train_drafter_resumes_and_its_head_is_lossless(
    tmp_path: Path, smollm2_tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    target = save_tiny_llama(
        tmp_path / "target", seed=3, vocab_size=49152, num_layers=4, tokenizer=smollm2_tokenizer
    )
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {
            "messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
            "split": "heldout" if i % 4 == 0 else "train",
        }
        for i in range(8)
    ]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out"
    common = ["train-drafter", "--model", str(target), "--out", str(out), "--prompts",
              str(prompts), "--device", "cpu", "--max-new-tokens", "12", "--draft-vocab-size",
              "256", "--ttt-steps", "3", "--batch-tokens", "256", "--report-prompts", "2",
              "--report-new-tokens", "8", "--save-every", "1",
              "--answers-per-prompt", "2"]  # fmt: skip
    assert cli_main([*common, "--epochs", "1", "--skip-report"]) == 0
    first = torch.load(out / "train_state.pt", weights_only=False)["step"]
    assert first > 0
    assert cli_main([*common, "--epochs", "2"]) == 0
    state = torch.load(out / "train_state.pt", weights_only=False)
    assert state["step"] == 2 * first  # resumed, not restarted
    report = json.loads((out / "report.json").read_text())
    assert len(report["training_time_test"]["acceptance_rate_per_position"]) == 7
    assert set(report["engines"]["configs"]) >= {"target only", "chain 3", "chain 5", "chain 7"}
    for row in report["engines"]["configs"].values():
        assert row["same_output_as_target_only"] == 2
    assert "held-out" in capsys.readouterr().out

    # the written head drives the drafter: speculative == target-only, token for token
    tokenizer = smollm2_tokenizer
    requests = [GenerationRequest([10, 20, 30 + i], 10, ignore_eos=True) for i in range(3)]
    plain = make_stack(target, "ngram", tokenizer, SpecParams(0, 1, 0), dtype=torch.float32)
    want = [generated_ids(c) for c in generate_all(plain, requests)]
    spec = SpecParams(3, 2, 5)
    stack = make_stack(target, "eagle3", tokenizer, spec, draft_dir=out / "head",
                       dtype=torch.float32)  # fmt: skip
    assert [generated_ids(c) for c in generate_all(stack, requests)] == want

    # --init-head starts from that head: with a zero learning rate it is written back unchanged
    # (same weights, same draft vocabulary)
    tuned = tmp_path / "tuned"
    init = ["--out", str(tuned), "--init-head", str(out / "head"), "--lr", "0"]
    args = [*common, "--epochs", "1", "--skip-report", *init]
    assert cli_main(args) == 0
    before, after = load_file(out / "head" / HEAD_WEIGHTS), load_file(tuned / "head" / HEAD_WEIGHTS)
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name
