"""End to end on the embedded default (SmolLM2-135M-Instruct GGUF, n-gram drafter): the services'
greedy output equals transformers' own `generate` on the same chat prompt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specsplit.model.embedded import embedded_default_model_path
from specsplit.prompt import apply_chat_template
from specsplit.v1 import common_pb2, gateway_pb2
from tests.integration.services import Services, generate, ids_of

MESSAGES = [{"role": "user", "content": "List three colours of the rainbow, then repeat the list."}]
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    svc = Services(embedded_default_model_path(), tmp_path_factory.mktemp("embedded"))
    yield from svc.serving(timeout=600)


def test_greedy_chat_equals_transformers_generate(services: Services, smollm2_tokenizer) -> None:
    path = Path(embedded_default_model_path())
    request = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in MESSAGES]),
        max_new_tokens=MAX_NEW_TOKENS,
        spec=common_pb2.SpecParams(num_steps=3, topk=1, num_draft_tokens=3),
    )
    out = generate(services.gateway(), request, timeout=300)
    ours = ids_of(out)

    prompt = apply_chat_template(smollm2_tokenizer, MESSAGES)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    expected = hf[0, len(prompt) :].tolist()
    assert ours == expected
    assert "".join(r.text for r in out) == smollm2_tokenizer.decode(ours, skip_special_tokens=True)
    assert out[-1].usage.prompt_tokens == len(prompt)
    stats = out[-1].spec_stats
    assert stats.rounds >= 1 and stats.mean_accepted_tokens >= 1.0
    services.wait_no_pages_used()
