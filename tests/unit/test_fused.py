"""specsplit/model/fused.py on any machine: torch.compile's kernels built in the process unless
the environment asks for inductor's pool of compile workers."""

from __future__ import annotations

import pytest
import torch._inductor.config as inductor_config

from specsplit.model.fused import compile_in_process


def test_compiles_in_the_process_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """No $TORCHINDUCTOR_COMPILE_THREADS: one compile thread, the process's own (no pool)."""
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    with inductor_config.patch(compile_threads=8):  # (restored after)
        compile_in_process()
        assert inductor_config.compile_threads == 1


def test_the_environment_keeps_its_compile_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """$TORCHINDUCTOR_COMPILE_THREADS set: inductor's own reading of it stands."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")
    with inductor_config.patch(compile_threads=4):
        compile_in_process()
        assert inductor_config.compile_threads == 4
