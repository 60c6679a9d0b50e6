"""GGUF's quantized weights (and bfloat16 ones) kept packed beside their float32 values, for
cpu_gemm.c's `quant_gemm` (the CPU's float32 route reads 0.75, 1.125 or 2 bytes a weight where
the float32 matrix costs 4, with the same bits, at any row count: past a few rows it forms each
weight once into a buffer and runs the float32 tiles over every row).

Why: a CPU decode step streams every weight once, so its time is the bytes it reads: the
embedded default (Q4_1 layers, a Q8_0 embedding tied to the LM head) is 538 MB in float32 and
~112 MB packed. The sums do not change: `quant_gemm` forms each weight in float32 exactly as
gguf's numpy dequantizes it (d * q exactly, then + m rounded once) and sums it in
`fixed_gemm`'s lanes and order, so a product is the same bits from the packed and the float32
weights (tests/unit/test_cpu_quant.py), and so is every token.

Packing (`pack`): Q4_0, Q4_1 and Q4_K blocks to kind 1 (float32 d, float32 m, the 16 bytes of
nibbles: 24 bytes a block of 32; Q4_0's m is -8 d, Q4_K's d and m its sub-block's scaled d and
-min, all exact), Q8_0 to kind 2 (float32 d, the 32 signed bytes: 36), Q6_K to kind 4 (two
float32 d, one a 16 weights, and 32 signed bytes: 40); a float32 matrix whose values are all
bfloat16 (a bfloat16 checkpoint run in float32, e.g. the shipped EAGLE-3 head) to kind 3, its
bfloat16 copy (`attach_bfloat16`). `attach` hangs a packed matrix on its float32 weight after
checking its first rows dequantize to that weight's values; `packed` returns it while the weight
keeps its storage and version (an in-place change drops it). `SPECSPLIT_CPU_QUANT=0` packs
nothing.

Panels (`panels`, kinds 5 and 6; made by the loader on a CPU with AMX's 8-bit tiles or AVX-512
VNNI unless $SPECSPLIT_CPU_INT8=0): kind-1 and kind-2 matrices regrouped 16 rows a panel for
cpu_gemm.c's `int8_gemm` / `vnni_gemm`, which take x as two 8-bit parts a block and so are near
the float32 product, not its bits: `int8_reference` gives their bits in torch. With VNNI and no
AMX (`cpu_gemm.half_panels`) the panels keep d and m as float16 where every one is a float16
(kinds 7 and 8: a GGUF Q4_0 / Q4_1 / Q8_0 matrix's; the same values, so the same bits): a
one-row step reads 0.83x the 4-bit layers' bytes (the embedded default's step 0.92-0.94x).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from specsplit.switches import env_switch

BLOCK = 32  # weights a block (cpu_gemm.c's QBLOCK)
KIND_4BIT, KIND_8BIT, KIND_BF16, KIND_8BIT_16 = 1, 2, 3, 4
KIND_4BIT_PANELS, KIND_8BIT_PANELS = 5, 6  # `panels`: cpu_gemm.c's int8_gemm
KIND_4BIT_HALF, KIND_8BIT_HALF = 7, 8  # `panels(half=True)`: their scales float16 (vnni_gemm)
BLOCK_BYTES = {KIND_4BIT: 24, KIND_8BIT: 36, KIND_BF16: 64, KIND_8BIT_16: 40}
PANEL_ROWS = 16
# bytes a panel's block (a record): 16 float d, 16 float m and 256 bytes of nibbles; 16 float d
# and 512 signed bytes; the same with float16 d and m
RECORD_BYTES = {
    KIND_4BIT_PANELS: 384,
    KIND_8BIT_PANELS: 576,
    KIND_4BIT_HALF: 320,
    KIND_8BIT_HALF: 544,
}
FOUR_BIT_KINDS = (KIND_4BIT, KIND_4BIT_PANELS, KIND_4BIT_HALF)  # each weight d * q + m
PANEL_KINDS = (KIND_4BIT, KIND_8BIT)  # the kinds `panels` regroups
# stored bytes a GGUF block, and the kind it packs to
_FORMATS = {
    GGMLQuantizationType.Q4_0: (18, KIND_4BIT),
    GGMLQuantizationType.Q4_1: (20, KIND_4BIT),
    GGMLQuantizationType.Q8_0: (34, KIND_8BIT),
    GGMLQuantizationType.Q4_K: (144, KIND_4BIT),  # a block of 256: 8 of ours
    GGMLQuantizationType.Q6_K: (210, KIND_8BIT_16),  # a block of 256: 8 of ours
}
CHECKED_ROWS = 64  # rows of each matrix `attach` dequantizes and compares with the weight


@functools.cache
def switch() -> bool:
    """$SPECSPLIT_CPU_QUANT: "1" (default) or "0"."""
    return env_switch("SPECSPLIT_CPU_QUANT")


def supported(qtype: GGMLQuantizationType) -> bool:
    return qtype in _FORMATS


@dataclass(frozen=True)
class Packed:
    """A weight matrix [rows, cols] as packed blocks: `data` uint8 [rows, cols / 32 * block
    bytes of `kind`], contiguous; panels (kinds 5 and 6) [ceil(rows / 16), cols / 32 * record
    bytes], their `panel_rows` the matrix's rows."""

    kind: int
    data: torch.Tensor
    cols: int
    panel_rows: int | None = None

    @property
    def rows(self) -> int:
        return self.data.shape[0] if self.panel_rows is None else self.panel_rows


def _halves(blocks: torch.Tensor) -> torch.Tensor:
    """float16 scalars stored as 2 little-endian bytes [..., 2] -> float32 [...]."""
    return blocks.contiguous().view(torch.float16).squeeze(-1).float()


def pack(qtype: GGMLQuantizationType, raw: torch.Tensor) -> Packed:
    """GGUF rows of `qtype` blocks (`raw`: uint8 [rows, row bytes], as GGUFFile.raw gives
    them) packed (module docstring)."""
    stored, kind = _FORMATS[qtype]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, stored)  # [rows, blocks, stored bytes]
    if qtype in _SUPER_BLOCKS:
        data = _SUPER_BLOCKS[qtype](blocks).reshape(rows, -1).contiguous()
        return Packed(kind, data, data.shape[1] // BLOCK_BYTES[kind] * BLOCK)
    d = _halves(blocks[..., 0:2])  # [rows, blocks]
    if qtype == GGMLQuantizationType.Q8_0:
        parts = [d.unsqueeze(-1).view(torch.uint8), blocks[..., 2:]]
    else:
        if qtype == GGMLQuantizationType.Q4_1:
            m, nibbles = _halves(blocks[..., 2:4]), blocks[..., 4:]
        else:
            m, nibbles = d * -8.0, blocks[..., 2:]
        scales = torch.stack([d, m], dim=-1)  # [rows, blocks, 2]
        parts = [scales.view(torch.uint8), nibbles]
    data = torch.cat(parts, dim=-1).reshape(rows, -1).contiguous()
    return Packed(kind, data, blocks.shape[1] * BLOCK)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks [rows, n, 144] -> kind-1 blocks [rows, n * 8, 24]. A block of 256: float16 d
    and dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles (sub-block 2j the
    low nibbles of bytes 32j..32j+31, 2j+1 their high ones); gguf dequantizes (d * sc) * q -
    dmin * m, where d * sc, dmin * m and (d * sc) * q are exact, so one rounding: our d = d *
    sc and m = -(dmin * m) give it."""
    rows, n = blocks.shape[:2]
    d, dmin = _halves(blocks[..., 0:2]), _halves(blocks[..., 2:4])  # [rows, n]
    low, high, mixed = blocks[..., 4:16].reshape(rows, n, 3, 4).unbind(dim=2)  # [rows, n, 4]
    sc = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=-1)  # [rows, n, 8]
    mins = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=-1)
    scales = torch.stack([d[..., None] * sc.float(), -(dmin[..., None] * mins.float())], dim=-1)
    qs = blocks[..., 16:].reshape(rows, n, 4, 1, 32)
    values = torch.cat([qs & 15, qs >> 4], dim=3).reshape(rows, n, 8, 32)  # [.., sub-block, 32]
    nibbles = values[..., :16] | (values[..., 16:] << 4)  # [rows, n, 8, 16]
    return torch.cat([scales.view(torch.uint8), nibbles], dim=-1)  # [rows, n, 8, 24]


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [rows, n, 210] -> kind-4 blocks [rows, n * 8, 40]. A block of 256: 128 bytes
    of low 4 bits, 64 of high 2 bits, 16 int8 scales (one a 16 weights), float16 d; gguf
    dequantizes (d * sc) * (q - 32), both products exact (d * sc 18 bits, times 6): our d for
    each 16 weights is d * sc, our int8 q - 32."""
    rows, n = blocks.shape[:2]
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [rows, n, 16]
    d = _halves(blocks[..., 208:210])  # [rows, n]
    low = ql.reshape(rows, n, 2, 1, 64)
    low = torch.cat([low & 15, low >> 4], dim=3).reshape(rows, n, 8, 32)
    high = qh.reshape(rows, n, 2, 1, 32)
    high = torch.cat([(high >> shift) & 3 for shift in (0, 2, 4, 6)], dim=3).reshape(rows, n, 8, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8)  # [rows, n, 8, 32]
    scales = (d[..., None] * sc).reshape(rows, n, 8, 2)  # a d for each 16 weights
    return torch.cat([scales.view(torch.uint8), q.view(torch.uint8)], dim=-1)  # [rows, n, 8, 40]


# formats of 256-weight blocks, each packed by its own function
_SUPER_BLOCKS = {GGMLQuantizationType.Q4_K: _q4_k, GGMLQuantizationType.Q6_K: _q6_k}


# a matrix as runs of rows, each packed in one kind: a fused projection whose parts a file stores
# in two formats (a Q4_K_M file's Q4_K q / k beside a Q6_K v) has a run each
Runs = tuple[Packed, ...]
MAX_RUNS = 3  # cpu_layer.c's Weight holds this many


def cat(parts: list[Packed]) -> Runs:
    """Matrices of one width stacked by rows (a fused projection's), neighbours of one kind in
    one run."""
    assert len({p.cols for p in parts}) == 1, [p.cols for p in parts]
    runs: list[list[Packed]] = []
    for part in parts:
        if runs and runs[-1][0].kind == part.kind:
            runs[-1].append(part)
        else:
            runs.append([part])
    return tuple(Packed(run[0].kind, torch.cat([p.data for p in run]), run[0].cols) for run in runs)


def panels(packed: Packed, half: bool = False) -> Packed:
    """A 4-bit (kind 1) or 8-bit (kind 2) matrix regrouped into panels of 16 rows (kind 5 or 6)
    for cpu_gemm.c's int8_gemm (its comment gives the records' layout); rows past the matrix's
    in the last panel zeros. half: with each d and m as float16 (kind 7 or 8, vnni_gemm's only:
    a one-row product reads 320 / 544 bytes a record instead of 384 / 576) where every one is a
    float16 exactly (a GGUF Q4_0 / Q4_1 / Q8_0 block's are; a Q4_K sub-block's d times its scale
    most often is not: kinds 5 and 6 then)."""
    d, m, q = _scales_and_q(packed)  # [rows, blocks], [rows, blocks], [rows, blocks, 32]
    half = half and all(torch.equal(t.half().float(), t) for t in (d, m))
    rows, blocks = d.shape
    num_panels = -(-rows // PANEL_ROWS)
    pad = num_panels * PANEL_ROWS - rows
    d, m = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (d, m))
    q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, pad))
    # [panel, block, 16] scales; q as [panel, block, half, tile row r, panel row n, byte j]
    d_p, m_p = (t.reshape(num_panels, PANEL_ROWS, blocks).transpose(1, 2) for t in (d, m))
    if half:
        d_p, m_p = d_p.half(), m_p.half()
    tiles = q.reshape(num_panels, PANEL_ROWS, blocks, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
    if packed.kind == KIND_4BIT:
        kind = KIND_4BIT_HALF if half else KIND_4BIT_PANELS
        nibbles = (tiles[:, :, 0] | (tiles[:, :, 1] << 4)).to(torch.uint8)  # [P, blocks, 4, 16, 4]
        parts = [_bytes(d_p), _bytes(m_p), nibbles.reshape(num_panels, blocks, 256)]
    else:
        kind = KIND_8BIT_HALF if half else KIND_8BIT_PANELS
        signed = tiles.to(torch.int8).contiguous().view(torch.uint8)
        parts = [_bytes(d_p), signed.reshape(num_panels, blocks, 512)]
    data = torch.cat(parts, dim=-1).reshape(num_panels, -1).contiguous()
    return Packed(kind, data, packed.cols, rows)


def _bytes(values: torch.Tensor) -> torch.Tensor:
    """float32 or float16 [..., n] -> its bytes uint8 [..., 4 n or 2 n]."""
    return values.contiguous().view(torch.uint8)


def _scales_and_q(packed: Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit or 8-bit matrix (kinds 1, 2, 5-8) as d and m float32 [rows, blocks] (m zeros
    for 8-bit) and q int16 [rows, blocks, 32]: each weight d * q + m."""
    if packed.kind in (KIND_4BIT, KIND_8BIT):
        blocks = packed.data.reshape(packed.rows, -1, BLOCK_BYTES[packed.kind])
        d = blocks[..., 0:4].contiguous().view(torch.float32).squeeze(-1)
        if packed.kind == KIND_8BIT:
            q = blocks[..., 4:].contiguous().view(torch.int8).to(torch.int16)
            return d, torch.zeros_like(d), q
        m = blocks[..., 4:8].contiguous().view(torch.float32).squeeze(-1)
        nibbles = blocks[..., 8:]
        return d, m, torch.cat([nibbles & 15, nibbles >> 4], dim=-1).to(torch.int16)
    num_panels = packed.data.shape[0]
    records = packed.data.reshape(num_panels, -1, RECORD_BYTES[packed.kind])
    num_blocks = records.shape[1]

    def rows_first(t: torch.Tensor) -> torch.Tensor:  # [P, blocks, 16, ...] -> [rows, blocks, ...]
        t = t.transpose(1, 2).reshape(num_panels * PANEL_ROWS, num_blocks, *t.shape[3:])
        return t[: packed.rows]

    scale, width = (torch.float16, 32) if packed.kind >= KIND_4BIT_HALF else (torch.float32, 64)
    d = rows_first(records[..., 0:width].contiguous().view(scale).float())
    if packed.kind in FOUR_BIT_KINDS:
        m = rows_first(records[..., width : 2 * width].contiguous().view(scale).float())
        nibbles = records[..., 2 * width :].reshape(num_panels, num_blocks, 4, PANEL_ROWS, 4)
        halves = torch.stack([nibbles & 15, nibbles >> 4], dim=2)  # [P, blocks, 2, 4, 16, 4]
    else:
        m = torch.zeros_like(d)
        halves = records[..., width:].contiguous().view(torch.int8)
        halves = halves.reshape(num_panels, num_blocks, 2, 4, PANEL_ROWS, 4)
    q = halves.permute(0, 1, 4, 2, 3, 5).reshape(num_panels, num_blocks, PANEL_ROWS, BLOCK)
    return d, m, rows_first(q.to(torch.int16))


def _int8_part(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of x [M, B, 32] rounded to 8 bits: (q int64 [M, B, 32], dx [M, B], sum of q float
    [M, B]), dx = max |x| / 127 and q = x * (127 / max |x|) rounded to nearest even."""
    amax = xb.abs().amax(dim=-1)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inverse[..., None]).clamp(-128, 127)
    return q.to(torch.int64), amax / 127.0, q.sum(dim=-1)


def int8_reference(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """cpu_gemm.c's int8_gemm in torch, the same bits: x float32 [M, cols] @ a 4-bit or 8-bit
    matrix's [rows, cols].T with each block of 32 x as two 8-bit parts (q1 = x rounded to 8 bits,
    dx1 = max |x| / 127; q2 = x - q1 * dx1 rounded likewise), each part's sum of q * weight q
    exact, then per block in increasing k, in float32: acc += d * (sum1 * dx1 + sum2 * dx2) + m
    * c, c = sum(q1) * dx1 + sum(q2) * dx2 (8-bit weights: no m term)."""
    d, m, q = _scales_and_q(packed)  # [N, B], [N, B], [N, B, 32]
    xb = x.reshape(x.shape[0], -1, BLOCK)  # [M, B, 32]
    q1, dx1, sx1 = _int8_part(xb)
    q2, dx2, sx2 = _int8_part(xb - q1.float() * dx1[..., None])
    c = sx1 * dx1 + sx2 * dx2  # [M, B]
    weights = q.to(torch.int64)
    sums1 = torch.einsum("mbk,nbk->mnb", q1, weights).float()  # [M, N, B], exact
    sums2 = torch.einsum("mbk,nbk->mnb", q2, weights).float()
    out = torch.zeros(x.shape[0], d.shape[0], dtype=torch.float32)
    four_bit = packed.kind in FOUR_BIT_KINDS
    for b in range(d.shape[1]):
        e = sums1[..., b] * dx1[:, b, None] + sums2[..., b] * dx2[:, b, None]
        term = d[None, :, b] * e
        if four_bit:
            term = term + m[None, :, b] * c[:, b, None]
        out = out + term
    return out


def dequantize(packed: Packed, rows: int | None = None) -> torch.Tensor:
    """The reference: the first `rows` (default all) of the matrix in float32 [rows, cols], each
    weight d * q + m (kinds 1, 5 and 7) or d * q (kinds 2, 6 and 8) as gguf's numpy forms it, or a
    bfloat16 widened (kind 3)."""
    if rows is not None:
        packed = _first_rows(packed, rows)
    if packed.kind == KIND_BF16:
        return packed.data.view(torch.bfloat16).float()
    if packed.kind == KIND_8BIT_16:
        blocks = packed.data.reshape(packed.rows, -1, BLOCK_BYTES[packed.kind])
        halves = blocks[..., 0:8].contiguous().view(torch.float32)  # [rows, blocks, 2]
        q = blocks[..., 8:].contiguous().view(torch.int8).float()  # [rows, blocks, 32]
        return (q.reshape(*q.shape[:2], 2, 16) * halves[..., None]).reshape(packed.rows, -1)
    d, m, q = _scales_and_q(packed)
    values = d[..., None] * q.float()
    if packed.kind in FOUR_BIT_KINDS:
        values = values + m[..., None]
    return values.reshape(packed.rows, -1)


def _first_rows(packed: Packed, rows: int) -> Packed:
    """The matrix's first `rows` rows (panels: the panels that hold them)."""
    if packed.kind not in RECORD_BYTES:
        return Packed(packed.kind, packed.data[:rows], packed.cols)
    rows = min(rows, packed.rows)
    return Packed(packed.kind, packed.data[: -(-rows // PANEL_ROWS)], packed.cols, rows)


def attach_bfloat16(weight: torch.Tensor) -> bool:
    """Hang the weight's bfloat16 copy (kind 3) on a float32 CPU matrix whose every value is a
    bfloat16 (a checkpoint stored in bfloat16 and run in float32) and whose width is a multiple
    of BLOCK; False (nothing attached) where not."""
    if not (weight.dim() == 2 and weight.shape[1] % BLOCK == 0 and weight.is_contiguous()):
        return False
    half = weight.to(torch.bfloat16)
    if not torch.equal(half.float(), weight):
        return False
    packed = Packed(KIND_BF16, half.view(torch.uint8), weight.shape[1])
    return attach(weight, packed)


def attach(weight: torch.Tensor, packed: Packed | Runs) -> bool:
    """Hang `packed` (a matrix, or its runs of rows) on `weight` (float32 [rows, cols] on the
    CPU) where the first CHECKED_ROWS rows of each run dequantize to the weight's values there;
    False (nothing attached) where not."""
    runs = (packed,) if isinstance(packed, Packed) else packed
    if not (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.is_contiguous()
        and 0 < len(runs) <= MAX_RUNS
        and all(run.cols == weight.shape[1] for run in runs)
        and sum(run.rows for run in runs) == weight.shape[0]
    ):
        return False
    row = 0
    for run in runs:
        checked = min(CHECKED_ROWS, run.rows)
        if not torch.equal(dequantize(run, checked), weight[row : row + checked]):
            return False
        row += run.rows
    weight._specsplit_packed = (runs, weight.data_ptr(), weight._version)  # type: ignore[attr-defined]
    return True


def packed(weight: torch.Tensor) -> Runs | None:
    """The packed runs `attach` hung on `weight`, while the weight keeps the storage and the
    version it had then (None otherwise, or with SPECSPLIT_CPU_QUANT=0)."""
    held = getattr(weight, "_specsplit_packed", None)
    if held is None or not switch():
        return None
    matrix, ptr, version = held
    if weight.data_ptr() != ptr or weight._version != version:
        return None
    return matrix  # type: ignore[no-any-return]
