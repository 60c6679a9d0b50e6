"""An EAGLE head (EAGLE-3, and the single-layer EAGLE-1/2 layout reading the target's final-normed
hidden state) across the real services: the drafter advertises the target layers it reads, the
gateway asks the verifier for them and carries them into the next Draft; output unchanged."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from specsplit.model.loader import load_model
from specsplit.v1 import common_pb2
from tests.eagle_random import save_random_eagle, save_random_eagle3
from tests.integration.services import Services, check_eagle_rounds_equal_target_only
from tests.support import save_tiny_llama

SPEC = common_pb2.SpecParams(num_steps=3, topk=2, num_draft_tokens=5)
NO_SPEC = common_pb2.SpecParams(num_steps=0, topk=1, num_draft_tokens=0)


@pytest.fixture(scope="module", params=["eagle3", "eagle"])
def services(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer
) -> Iterator[Services]:
    root = tmp_path_factory.mktemp(f"{request.param}_services")
    target = save_tiny_llama(
        root / "target", seed=6, vocab_size=49152, num_layers=4, tokenizer=smollm2_tokenizer
    )
    _, config = load_model(str(target), dtype=torch.float32, device="cpu")
    if request.param == "eagle3":
        head = save_random_eagle3(root / "head", config, seed=2, draft_vocab_size=300)
    else:
        head = save_random_eagle(root / "head", config, seed=2)
    svc = Services(
        str(target),
        root,
        extra={"drafter": ["--drafter", "eagle3", "--draft-model", str(head)]},
        # EAGLE-3 on Unix sockets: its rounds (features both ways) on the round lanes
        unix_dir=root if request.param == "eagle3" else None,
    )
    yield from svc.serving()


def test_eagle3_over_the_services_equals_target_only_and_frees_kv(services: Services) -> None:
    prompts = [[100 + 7 * i + j for j in range(5 + 3 * i)] for i in range(3)]
    check_eagle_rounds_equal_target_only(services, prompts, 12, SPEC)
    if services.unix_dir is not None:
        for role in ("drafter", "verifier"):
            assert "round lane on" in services.log(role, whole=True)
