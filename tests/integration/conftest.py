"""Fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.services import TINY_MODEL_NAME, TINY_VOCAB_SIZE, Services
from tests.support import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_http_services(
    tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer
) -> Iterator[Services]:
    """The three processes with the OpenAI HTTP API on, serving a tiny random Llama with
    SmolLM2's tokenizer as TINY_MODEL_NAME, the drafter drafting with the target itself (every
    draft accepted). Shared by the modules that only talk to the gateway and leave no KV."""
    root = tmp_path_factory.mktemp("tiny_http")
    model = save_tiny_llama(
        root / "target", seed=5, vocab_size=TINY_VOCAB_SIZE, tokenizer=smollm2_tokenizer
    )
    svc = Services(
        str(model),
        root,
        extra={
            "drafter": ["--drafter", "model", "--draft-model", str(model)],
            "gateway": ["--served-model-name", TINY_MODEL_NAME],
        },
        http=True,
    )
    yield from svc.serving()
