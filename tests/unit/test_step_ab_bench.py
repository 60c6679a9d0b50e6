"""bench/step_ab.py's parts that run without a GPU: variants parse from NAME=KEY=VALUE,..., each
variant sets its switches and leaves the rest at their defaults, a tiny model's run through the
alternation reports every variant with the same tokens (the CPU path ignores the GPU switches),
and programmatic dependent launch is never used off a GPU."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch

from bench import step_ab
from specsplit.kernels import paged_attention, small_linear_tiles, triton_jit
from specsplit.model import llama


@pytest.fixture
def restore_switches() -> Iterator[None]:
    names = (
        [
            (triton_jit, "PDL_SWITCH"),
            (llama, "SMALL_LINEAR_ROWS"),
            (llama, "SMALL_LINEAR_MAX_WEIGHT_BYTES"),
        ]
        + [
            (paged_attention, name)
            for name in (
                "PAGES_AHEAD",
                "SKIP_EMPTY_CHUNKS",
                "DECODE_STAGES",
                "WIDE_BLOCK_N",
                "WIDE_WARPS",
                "WIDE_SPLIT_PROGRAMS_PER_SM",
                "SPLIT_PROGRAMS_PER_SM",
                "LARGE_HEAD_SPLIT_PROGRAMS_PER_SM",
            )
        ]
        + [
            (small_linear_tiles, name)
            for name in (
                "PREFETCH",
                "PREFETCH_MAX_LINES",
                "PDL_ON_TENSOR_CORES",
                "PDL_TRIGGER_LATE",
                "DOT_ROWS",
                "DOT_TILES",
            )
        ]
    )
    before = [getattr(module, name) for module, name in names]
    yield
    for (module, name), value in zip(names, before, strict=True):
        setattr(module, name, value)


def test_variants_parse_and_refuse_unknown_switches() -> None:
    variant = step_ab.parse_variant("fast=pdl=1,rows=32,tiles=32/64/4/4")
    assert variant.name == "fast"
    assert variant.switches == {"pdl": "1", "rows": "32", "tiles": "32/64/4/4"}
    assert step_ab.parse_variant("base=").switches == {}
    for bad in ("=pdl=1", "x=speed=2", "x=pdl"):
        with pytest.raises(Exception, match=r"NAME|one of"):
            step_ab.parse_variant(bad)


@pytest.mark.usefixtures("restore_switches")
def test_a_variant_sets_its_switches_and_the_rest_go_back_to_their_defaults() -> None:
    variant = step_ab.parse_variant(
        "a=pdl=0,prefetch=0,pdl_dot=1,late=1,rows=32,tiles=32/64/4/4,max_weight_mb=1024,"
        "prefetch_lines=8,pages_ahead=1"
    )
    step_ab.apply(variant)
    assert paged_attention.PAGES_AHEAD is True
    assert llama.SMALL_LINEAR_MAX_WEIGHT_BYTES == 1 << 30
    assert small_linear_tiles.PREFETCH_MAX_LINES == 8
    assert triton_jit.PDL_SWITCH == "0" and small_linear_tiles.PREFETCH is False
    assert small_linear_tiles.PDL_ON_TENSOR_CORES is True
    assert small_linear_tiles.PDL_TRIGGER_LATE is True
    assert llama.SMALL_LINEAR_ROWS == 32 and small_linear_tiles.DOT_ROWS == 32
    assert small_linear_tiles.DOT_TILES == (32, 64, 4, 4)
    step_ab.apply(step_ab.parse_variant("b=rows=16"))
    assert step_ab.DEFAULTS["pdl"] == triton_jit.PDL_SWITCH
    assert small_linear_tiles.PREFETCH is (step_ab.DEFAULTS["prefetch"] == "1")
    assert small_linear_tiles.PDL_ON_TENSOR_CORES is (step_ab.DEFAULTS["pdl_dot"] == "1")
    assert small_linear_tiles.PDL_TRIGGER_LATE is (step_ab.DEFAULTS["late"] == "1")
    assert llama.SMALL_LINEAR_ROWS == 16 and small_linear_tiles.DOT_ROWS == 16
    assert small_linear_tiles.DOT_TILES is None
    assert llama.SMALL_LINEAR_MAX_WEIGHT_BYTES == 16 << 20
    assert small_linear_tiles.PREFETCH_MAX_LINES is None
    assert paged_attention.PAGES_AHEAD is False
    for bad in ("c=max_weight_mb=0", "c=prefetch_lines=3"):
        with pytest.raises(SystemExit, match=r"max_weight_mb|prefetch_lines"):
            step_ab.apply(step_ab.parse_variant(bad))


def tiny_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[str, list[str]]:
    """step_ab on the tiny model, batches 1 and 2, two turns of two rounds, and `args`: its
    output and the rows of its table (variants only)."""
    argv = ["step_ab.py", "--shape", "tiny", "--batch", "1", "2", "--context", "24", "--reps",
            "2", "--steps", "2", *args]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    step_ab.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    for row in rows[1:]:
        assert row.count("tokens same") == 2, row
    return out, rows[1:]


@pytest.mark.usefixtures("restore_switches")
def test_a_tiny_run_reports_every_variant_with_the_first_ones_tokens(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, rows = tiny_run(monkeypatch, capsys, "--decode-steps", "2", "--variant", "base=",
                       "--variant", "pdl=pdl=0", "--variant", "small=rows=16")  # fmt: skip
    assert [row.split(" | ")[0] for row in rows] == ["| base", "| pdl", "| small"]
    assert "1.000x" in rows[0]


def test_pdl_is_never_used_off_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_jit, "PDL_SWITCH", "1")
    assert not triton_jit.pdl(torch.device("cpu"))
    monkeypatch.setenv("SPECSPLIT_PDL", "2")
    with pytest.raises(SystemExit, match="SPECSPLIT_PDL"):
        triton_jit._pdl_switch()
    monkeypatch.setenv("SPECSPLIT_PDL", "1")
    assert triton_jit._pdl_switch() == "1"


@pytest.mark.usefixtures("restore_switches")
def test_verify_rounds_alternate_the_wide_blocks_switches_with_the_same_tokens(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wide = "wide=wide_split=4,wide_block_n=32,wide_warps=8"
    out, rows = tiny_run(monkeypatch, capsys, "--verify-n", "3", "--variant", "base=",
                         "--variant", wide)  # fmt: skip
    assert "verify rounds of 1 + 3" in out and "ms a verify 1+3 round" in out
    assert [row.split(" | ")[0] for row in rows] == ["| base", "| wide"]
    step_ab.apply(
        step_ab.parse_variant("w=wide_split=4,wide_block_n=32,wide_warps=8,split=2,split_large=5")
    )
    assert paged_attention.WIDE_SPLIT_PROGRAMS_PER_SM == 4
    assert paged_attention.SPLIT_PROGRAMS_PER_SM == 2
    assert paged_attention.LARGE_HEAD_SPLIT_PROGRAMS_PER_SM == 5
    assert (paged_attention.WIDE_BLOCK_N, paged_attention.WIDE_WARPS) == (32, 8)
    step_ab.apply(step_ab.parse_variant("base="))
    assert int(step_ab.DEFAULTS["wide_split"]) == paged_attention.WIDE_SPLIT_PROGRAMS_PER_SM
    assert int(step_ab.DEFAULTS["split"]) == paged_attention.SPLIT_PROGRAMS_PER_SM == 4
    assert int(step_ab.DEFAULTS["split_large"]) == paged_attention.LARGE_HEAD_SPLIT_PROGRAMS_PER_SM
