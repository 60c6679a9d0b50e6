"""The in-process stack (benchmarks, notebooks) can run batch after batch, each its own
event loop, with the same output every time."""

from __future__ import annotations

import torch

from gateway.request import GenerationRequest
from specsplit.messages import SpecParams
from tests.support import generate_all, generated_ids, make_stack, save_tiny_llama


def test_local_stack_generates_again_on_a_new_event_loop(tmp_path, smollm2_tokenizer) -> None:
    target = save_tiny_llama(tmp_path / "t", seed=4)
    stack = make_stack(target, "ngram", smollm2_tokenizer, SpecParams(3, 1, 3), dtype=torch.float32)
    requests = [GenerationRequest([5, 6, 7 + i], 6, ignore_eos=True) for i in range(2)]
    first = [generated_ids(c) for c in generate_all(stack, requests)]
    second = [generated_ids(c) for c in generate_all(stack, requests)]
    assert first == second and all(len(ids) == 6 for ids in first)
