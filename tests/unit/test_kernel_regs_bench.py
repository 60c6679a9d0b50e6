"""bench/kernel_regs.py without a GPU: the paged-attention kernel compiles for sm_90a (Triton's
codegen and its bundled ptxas, not the interpreter) in the wrapper's configs and with every
constexpr branch the interpreter tests cannot compile (PDL, a tree mask, the split's partials,
page ids a tile ahead), and the report carries ptxas's registers and Triton's shared memory."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from bench.kernel_regs import compile_attention


@pytest.mark.parametrize(
    "flags",
    [{}, {"HAS_TREE": True}, {"SPLIT": True}, {"PAGES_AHEAD": True}],
    ids=["causal", "tree", "split", "pages-ahead"],
)
def test_the_attention_kernel_compiles_for_sm90_and_reports_its_resources(flags: dict) -> None:
    got = compile_attention(4, 128, 16, 64, 4, 2, **flags)  # the 8B's decode rows, split tile
    assert 0 < got["registers"] <= 255
    assert got["spill_stores"] >= 0 and got["stack"] >= 0
    assert got["shared"] > 0  # (the dots' operands)
