"""bench/e2e.py's batches: the prompts in groups, HF `generate` on a left-padded group giving each
prompt's tokens as alone (float32, a tiny random Llama), rows cut after their first EOS, or run
on to max_new_tokens past it (--ignore-eos)."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest
import torch
from prometheus_client.samples import Sample
from transformers import LlamaConfig, LlamaForCausalLM

from bench import e2e
from bench.e2e import hf_runners, left_padded, prompt_groups, through_eos

EOS = 7  # the tiny model below draws it first after the third prompt, not after the others


def test_groups_keep_the_prompts_in_order_and_cycle_to_fill_the_last() -> None:
    prompts = [[1], [2], [3]]
    assert prompt_groups(prompts, 1) == [[[1]], [[2]], [[3]]]
    assert prompt_groups(prompts, 2) == [[[1], [2]], [[3], [1]]]
    assert prompt_groups(prompts, 8) == [[[1], [2], [3], [1], [2], [3], [1], [2]]]


def test_left_padding_puts_each_prompt_at_the_end_with_its_mask() -> None:
    ids, mask = left_padded([[7, 8, 9], [4]], pad=0)
    assert ids.tolist() == [[7, 8, 9], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_a_row_ends_with_its_first_eos() -> None:
    assert through_eos([4, EOS, 0, 0], {EOS}) == [4, EOS]
    assert through_eos([4, 6, 7], {EOS}) == [4, 6, 7]  # max_new_tokens reached first
    assert through_eos([EOS], {EOS, 2}) == [EOS]


def _tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = None
    return model


def test_a_padded_group_gives_each_prompt_its_tokens_alone() -> None:
    model = _tiny_model()
    args = argparse.Namespace(device="cpu", max_new_tokens=12, assistant_layers=0, ignore_eos=False)
    prompts = [[1, 9, 17, 33, 40], [2, 3], [60, 11, 12, 13, 14, 15, 16, 21]]
    alone = hf_runners(args, model, 32, batch=1)
    together = hf_runners(args, model, 32, batch=len(prompts))
    # prompt lookup and assisted: batch 1 only; the static cache + compile on the CPU too
    compiled = "HF generate static cache + compile"
    assert set(together) == {"HF generate", compiled}
    assert set(alone) == {"HF generate", "HF generate prompt_lookup 3", compiled}
    expected = [alone["HF generate"]([p])[0] for p in prompts]
    assert together["HF generate"](prompts) == expected
    # one row ends at its EOS while the others run on: the group's row is cut there too
    assert sorted(len(tokens) for tokens, _, _ in expected) == [1, 12, 12]


def test_with_ignore_eos_every_row_runs_to_max_new_tokens_past_its_eos() -> None:
    """--ignore-eos: HF generates on past EOS (no stop, no cut), as specsplit's streams with
    ignore_eos do, so both sides time the same number of tokens; the tokens before the EOS are
    those of a run that stops there."""
    model, prompts = _tiny_model(), [[60, 11, 12, 13, 14, 15, 16, 21], [2, 3]]
    stopping = argparse.Namespace(
        device="cpu", max_new_tokens=12, assistant_layers=0, ignore_eos=False
    )
    past = argparse.Namespace(**{**vars(stopping), "ignore_eos": True})
    for batch in (1, len(prompts)):
        stopped = hf_runners(stopping, model, 32, batch=batch)["HF generate"]
        ran_on = hf_runners(past, model, 32, batch=batch)["HF generate"]
        groups = [[p] for p in prompts] if batch == 1 else [prompts]
        for group in groups:
            for (cut, _, _), (whole, _, _) in zip(stopped(group), ran_on(group), strict=True):
                assert len(whole) == 12
                assert whole[: len(cut)] == cut
    assert stopped([prompts[0]])[0][0] == [EOS]  # (that prompt's first token is the EOS)


def test_scrape_totals_keeps_unlabelled_sums_and_counts_and_outcomes_by_label(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unlabelled histograms' sums and counts are kept by name, unlabelled counters are not,
    labelled ones by their label."""
    samples = [
        ("gateway", Sample("specsplit_decoded_tokens_total", {}, 12.0)),
        ("gateway", Sample("specsplit_generated_tokens_total", {}, 40.0)),
        ("drafter", Sample("specsplit_draft_seconds_sum", {}, 0.5)),
        ("drafter", Sample("specsplit_draft_seconds_count", {}, 4.0)),
        ("verifier", Sample("specsplit_decode_ahead_total", {"outcome": "used"}, 3.0)),
    ]
    monkeypatch.setattr(e2e, "_samples", lambda: iter(samples))
    assert e2e.scrape_totals() == {
        ("drafter", "specsplit_draft_seconds_sum"): 0.5,
        ("drafter", "specsplit_draft_seconds_count"): 4.0,
        ("verifier", "specsplit_decode_ahead_total:used"): 3.0,
    }


def test_measure_counts_the_streams_a_later_pass_changed() -> None:
    """--passes: a stream whose tokens in a later pass are not its first pass's is counted in
    its row (bf16 near-ties at another batch shape), not an error that loses the run."""
    calls = Counter[str]()

    def runner(name: str, flip: bool) -> e2e.Runner:
        def run(group: list[list[int]]) -> list[tuple[list[int], int, int]]:
            calls[name] += 1
            later = calls[name] > 3  # the warm-up group, then pass 1's two groups
            return [([7, 1 if flip and later and k == 0 else 2], 2, 2) for k in range(len(group))]

        return run

    runners = {"HF generate": runner("HF generate", True), "HF other": runner("HF other", False)}
    rows = e2e.measure(runners, [[[1], [2]], [[3], [4]]], passes=3)
    assert rows["HF generate"].num_changed == 4  # stream 0 of each group, passes 2 and 3
    assert rows["HF other"].num_changed == 0
    assert rows["HF generate"].outputs == [[7, 2]] * 4  # the first pass's tokens
    assert rows["HF generate"].num_timed_tokens == 3 * 4 * 2  # every pass's, as timed


def test_gated_rounds_print_each_kinds_count_and_mean(capsys: pytest.CaptureFixture[str]) -> None:
    """--speculation-gate on: each specsplit row's gated rounds by kind (count x mean ms) from
    the gateway's gate histograms; HF rows have none."""
    row = e2e.Row()
    row.totals.update(
        {
            ("gateway", "specsplit_gate_speculating_round_seconds_count"): 4.0,
            ("gateway", "specsplit_gate_speculating_round_seconds_sum"): 0.02,
            ("gateway", "specsplit_gate_plain_round_seconds_count"): 60.0,
            ("gateway", "specsplit_gate_plain_round_seconds_sum"): 0.6,
        }
    )
    e2e.print_gated_rounds({"specsplit default shape": row, "HF generate": e2e.Row()})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3  # the title, the header, the one specsplit row
    cells = lines[2].removeprefix("specsplit default shape").split()
    assert cells == ["4", "x", "5.00", "60", "x", "10.00", "0", "x", "-"]
