"""cpu_gemm.c's int8_gemm (4-bit and 8-bit GGUF weights in panels, x as two 8-bit parts a block,
AMX's integer tiles; the CPU's default where it has them, $SPECSPLIT_CPU_INT8=0 off): panels
dequantize to their source's values; a product is `cpu_quant.int8_reference`'s bits (torch) at
every row count and panel count, so a row's result does not depend on the rows beside it; the
reference is within ~1e-5 of the float product; a model loaded with $SPECSPLIT_CPU_INT8=1 has
its 4-bit / 8-bit matrices in panels, gives a verify's rows the bits one-token steps give them
(what greedy speculation's equality with the target alone rests on) and logits within 1e-3 of
the float32 route's; =0 loads no panels. The kernel's cases run on AMX's tiles and on AVX-512
VNNI (vnni_gemm, the same bits), each skipped on a CPU without it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from gguf import GGMLQuantizationType

from specsplit.model import cpu_gemm, cpu_quant
from specsplit.model.cpu_gemm import fixed_linear
from specsplit.model.embedded import embedded_default_model_path
from specsplit.model.llama import LlamaModel, make_kv_cache
from specsplit.model.loader import load_model, model_matrices
from specsplit.step import build_forward_batch, causal_step
from tests.unit.test_cpu_quant import _matrix

Q = GGMLQuantizationType
PANEL_FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0]

pytestmark = pytest.mark.usefixtures("cpu_kernel")


@pytest.fixture
def int8_tiles(cpu_kernel: cpu_gemm.Library) -> None:
    if not cpu_kernel.int8_ready:
        pytest.skip("this CPU has neither AMX's 8-bit tiles nor AVX-512 VNNI")


@pytest.fixture(params=["amx", "vnni"])
def int8_kernel(request: pytest.FixtureRequest, cpu_kernel: cpu_gemm.Library) -> Iterator[str]:
    """Every product on panels through one kernel (AMX's tiles or AVX-512 VNNI), at any rows."""
    if not getattr(cpu_kernel, request.param):
        pytest.skip(f"this CPU has no {request.param}")
    was = cpu_kernel.int8_kernel_rows(1 if request.param == "amx" else 1 << 40)
    yield request.param
    cpu_kernel.int8_kernel_rows(was)


@pytest.fixture
def int8_on(monkeypatch: pytest.MonkeyPatch, int8_tiles: None) -> Iterator[None]:
    monkeypatch.setenv("SPECSPLIT_CPU_INT8", "1")
    monkeypatch.setenv("SPECSPLIT_CPU_QUANT", "1")
    cpu_gemm.int8_switch.cache_clear()
    cpu_quant.switch.cache_clear()
    yield
    cpu_gemm.int8_switch.cache_clear()
    cpu_quant.switch.cache_clear()


def _panels(
    qtype: Q, rows: int, cols: int, seed: int = 0, half: bool = False
) -> tuple[cpu_quant.Packed, torch.Tensor]:
    raw, values = _matrix(qtype, rows, cols, seed)
    return cpu_quant.panels(cpu_quant.pack(qtype, raw), half), values


# the kinds `panels` gives a format's matrix: float32 scales, float16 ones where asked (a Q4_K
# sub-block's d times its 6-bit scale is not a float16: its scales stay float32)
KINDS = {
    (False, Q.Q8_0): cpu_quant.KIND_8BIT_PANELS, (True, Q.Q8_0): cpu_quant.KIND_8BIT_HALF,
    (False, Q.Q4_K): cpu_quant.KIND_4BIT_PANELS, (True, Q.Q4_K): cpu_quant.KIND_4BIT_PANELS,
    **{(False, q): cpu_quant.KIND_4BIT_PANELS for q in (Q.Q4_0, Q.Q4_1)},
    **{(True, q): cpu_quant.KIND_4BIT_HALF for q in (Q.Q4_0, Q.Q4_1)},
}  # fmt: skip


@pytest.mark.parametrize("half", [False, True], ids=["float32-scales", "float16-scales"])
@pytest.mark.parametrize("qtype", PANEL_FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [16, 37])
def test_panels_dequantize_to_their_sources_values(qtype: Q, rows: int, half: bool) -> None:
    """Rows a multiple of 16 and not (the last panel's rows past the matrix zeros)."""
    cols = 256 if qtype == Q.Q4_K else 96
    panels, values = _panels(qtype, rows, cols, half=half)
    kind = KINDS[(half, qtype)]
    assert (panels.kind, panels.rows, panels.data.shape[0]) == (kind, rows, -(-rows // 16))
    assert panels.data.shape[1] == cols // 32 * cpu_quant.RECORD_BYTES[kind]
    assert torch.equal(cpu_quant.dequantize(panels), values)
    assert torch.equal(cpu_quant.dequantize(panels, 5), values[:5])


@pytest.mark.parametrize("half", [False, True], ids=["float32-scales", "float16-scales"])
@pytest.mark.parametrize("qtype", PANEL_FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("weight_rows", [53, 37])  # panels in pairs, the last partial; a lone last
def test_an_int8_product_is_the_references_bits_at_every_row_count(
    qtype: Q, weight_rows: int, int8_kernel: str, half: bool
) -> None:
    """Float16 scales (VNNI's only: on AMX's run the products go to VNNI all the same) give
    float32 scales' bits: the same values."""
    cols = 256 if qtype == Q.Q4_K else 160
    panels, values = _panels(qtype, weight_rows, cols, seed=3, half=half)
    assert panels.kind == KINDS[(half, qtype)]
    weight = values.clone()
    assert cpu_quant.attach(weight, panels)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(1))
    x[3, :32] = 0.0  # a block of zeros (its scale 0)
    x[5, 40] = 1e4  # a block one value dominates
    want = cpu_quant.int8_reference(x, panels)
    got = fixed_linear(x, weight)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for num_rows in (1, 2, 15, 16, 17, 33):  # one tile of x, several, a partial one
        alone = fixed_linear(x[:num_rows], weight)
        assert torch.equal(alone.view(torch.int32), got[:num_rows].view(torch.int32)), num_rows
    if half:  # the same bits as the float32 scales' panels
        full = values.clone()
        assert cpu_quant.attach(full, _panels(qtype, weight_rows, cols, seed=3)[0])
        assert torch.equal(fixed_linear(x, full).view(torch.int32), got.view(torch.int32))


def test_the_int8_reference_is_the_float_product_within_two_8_bit_parts_rounding() -> None:
    panels, values = _panels(Q.Q4_1, 64, 512, seed=5)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(2))
    exact = (x.double() @ values.double().T).float()
    got = cpu_quant.int8_reference(x, panels)
    relative = (got - exact).norm() / exact.norm()
    # x as two 8-bit parts (~15 bits): not the float32 product, within ~1e-5 of it
    assert 1e-7 < relative < 1e-4, relative


@pytest.mark.usefixtures("float32_products")
def test_without_the_switch_a_model_loads_without_panels() -> None:
    assert not cpu_gemm.int8_route()
    model, _ = load_model(embedded_default_model_path(), torch.float32, "cpu", num_layers=1)
    kinds = {run.kind for w in model_matrices(model) for run in cpu_quant.packed(w) or ()}
    assert kinds == {cpu_quant.KIND_4BIT, cpu_quant.KIND_8BIT}


def _step_logits(
    model: LlamaModel, prefix: list[int], tokens: list[int], rows: int
) -> torch.Tensor:
    """After a prefill of `prefix`: `tokens` run `rows` a step, every row's logits."""
    kv = make_kv_cache(model.config, 16, 16, torch.float32, "cpu")
    seq = kv.new_seq()
    kv.reserve(seq, len(prefix) + len(tokens))
    model(build_forward_batch([causal_step(seq, prefix, [len(prefix) - 1])], 16)[0], kv)
    seq.kv_committed_len = len(prefix)
    out = []
    for start in range(0, len(tokens), rows):
        chunk = tokens[start : start + rows]
        step = causal_step(seq, chunk, list(range(len(chunk))))
        out.append(model(build_forward_batch([step], 16)[0], kv).logits)
        seq.kv_committed_len += len(chunk)
    kv.release(seq)
    return torch.cat(out)


def test_the_embedded_default_in_panels_gives_a_verifys_rows_a_steps_bits(int8_on: None) -> None:
    """Its Q4_1 projections and Q8_0 LM head in panels (two layers): a 6-token verify's logits
    are the bits of six one-token steps, and within 1e-3 of the float32 route's (relative)."""
    assert cpu_gemm.int8_route()
    model, _ = load_model(embedded_default_model_path(), torch.float32, "cpu", num_layers=2)
    kinds = {run.kind for w in model_matrices(model) for run in cpu_quant.packed(w) or ()}
    if cpu_gemm.half_panels():  # (AVX-512 VNNI without AMX: float16 scales)
        assert kinds == {cpu_quant.KIND_4BIT_HALF, cpu_quant.KIND_8BIT_HALF}
    else:
        assert kinds == {cpu_quant.KIND_4BIT_PANELS, cpu_quant.KIND_8BIT_PANELS}
    prefix, tokens = list(range(100, 140)), [5, 900, 77, 4000, 12, 310]
    verify = _step_logits(model, prefix, tokens, rows=6)
    steps = _step_logits(model, prefix, tokens, rows=1)
    assert torch.equal(verify.view(torch.int32), steps.view(torch.int32))
    float32, _ = load_model(embedded_default_model_path(), torch.float32, "cpu", num_layers=2)
    for weight in model_matrices(float32):  # the same values, read by the float32 route
        weight._specsplit_packed = None  # type: ignore[attr-defined]
    plain = _step_logits(float32, prefix, tokens, rows=6)
    assert ((verify - plain).norm() / plain.norm()) < 1e-3
