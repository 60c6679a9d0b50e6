"""A service sets its start-up's objects aside from Python's garbage collector once loaded
(`specsplit.server.freeze_startup`: a full collection would otherwise walk the loaded model's
and tokenizer's hundreds of thousands of objects, stopping the process), and every collection's
pause is in /metrics (`specsplit_gc_pause_seconds`, by generation). Once loaded it also pins
itself to the cores it was given, if any (`--cpu-cores`, which `specsplit up` sets)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from specsplit import server
from specsplit.server import ServiceHost
from tests.support import save_tiny_llama
from verifier.engine import VerifierEngine
from verifier.servicer import VerifierServicer


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    """Each case starts and ends with nothing set aside (the suite runs in one process)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _load_a_verifier(
    target: Path, tmp_path: Path, cpu_cores: frozenset[int] | None = None
) -> VerifierEngine:
    engine: list[VerifierEngine] = []

    async def run() -> None:
        servicer = VerifierServicer(lambda: VerifierEngine.load(str(target), num_pages=64))
        address = f"unix:{tmp_path}/verifier.sock"
        host = ServiceHost(servicer, address, grace=0.1, cpu_cores=cpu_cores)
        await host.start()
        try:
            await host.load()
            assert servicer.engine.loaded is not None
            engine.append(servicer.engine.loaded)
        finally:
            await host.stop()

    asyncio.run(run())
    return engine[0]


def _full_collections() -> tuple[float, float]:
    sample = REGISTRY.get_sample_value
    labels = {"generation": "2"}
    return (
        sample("specsplit_gc_pause_seconds_count", labels) or 0.0,
        sample("specsplit_gc_pause_seconds_sum", labels) or 0.0,
    )


def test_a_loaded_service_sets_its_objects_aside_and_each_collection_is_timed(
    tmp_path: Path,
) -> None:
    target = save_tiny_llama(tmp_path / "target", seed=3)
    engine = _load_a_verifier(target, tmp_path)
    assert gc.get_freeze_count() > 0
    # the engine's own objects are among them: no collection walks them (get_objects lists
    # those the collector holds, the frozen ones not)
    assert not any(o is engine.kv for o in gc.get_objects())
    before_count, before_seconds = _full_collections()
    gc.collect()
    count, seconds = _full_collections()
    assert count == before_count + 1 and seconds > before_seconds


def test_the_freeze_can_be_switched_off_for_a_bench(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSPLIT_GC_FREEZE", "0")
    engine = _load_a_verifier(save_tiny_llama(tmp_path / "target", seed=3), tmp_path)
    assert gc.get_freeze_count() == 0
    assert any(o is engine.kv for o in gc.get_objects())


def test_a_service_pins_itself_to_its_cores_once_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pinned: list[frozenset[int]] = []
    monkeypatch.setattr(server, "pin_to_cores", pinned.append)
    _load_a_verifier(save_tiny_llama(tmp_path / "target", seed=3), tmp_path, frozenset({30, 31}))
    assert pinned == [{30, 31}]
    _load_a_verifier(save_tiny_llama(tmp_path / "other", seed=3), tmp_path)
    assert pinned == [{30, 31}]  # none given: left where it is
