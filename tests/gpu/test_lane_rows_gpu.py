"""The three services as processes on the GPU(s), the drafter (an EAGLE-3 head) and the verifier
on Unix sockets: Draft rounds come over the round lane with the target's feature rows, which the
drafter reads into page-locked memory and copies to its device from there. Speculative output
equals target-only (float32), and no KV is left. Skipped where there is no GPU (CI)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from specsplit.model.loader import load_model
from specsplit.v1 import common_pb2
from tests.eagle_random import save_random_eagle3
from tests.integration.services import Services, check_eagle_rounds_equal_target_only
from tests.support import save_tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SPEC = common_pb2.SpecParams(num_steps=3, topk=1, num_draft_tokens=3)


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("lane_rows_gpu")
    target = save_tiny_llama(
        root / "target", seed=6, vocab_size=49152, num_layers=4, tokenizer=smollm2_tokenizer
    )
    _, config = load_model(str(target), dtype=torch.float32, device="cpu")
    head = save_random_eagle3(root / "head", config, seed=2, draft_vocab_size=300)
    last = f"cuda:{torch.cuda.device_count() - 1}"
    gpu = ["--dtype", "float32", "--num-pages", "512"]
    eagle = ["--drafter", "eagle3", "--draft-model", str(head)]
    svc = Services(
        str(target),
        root,
        extra={
            "drafter": ["--device", "cuda:0", *gpu, *eagle],
            "verifier": ["--device", last, *gpu],
        },
        unix_dir=root,
    )
    yield from svc.serving()


def test_feature_rows_over_the_lane_land_pinned_and_output_equals_target_only(
    services: Services,
) -> None:
    # long prompts: the first Draft's rows (every prompt token's features) outgrow the lane's
    # scratch buffer, so they are read into a buffer of their own
    prompts = [[100 + (7 * i + 3 * j) % 900 for j in range(120 + 30 * i)] for i in range(3)]
    check_eagle_rounds_equal_target_only(services, prompts, 24, SPEC)
    drafter_log = services.log("drafter", whole=True)  # the lane starts before the warm-up
    assert "round lane on" in drafter_log
    assert "reads feature rows into page-locked memory" in drafter_log
