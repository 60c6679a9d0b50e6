"""The chained round's placement kernels (specsplit/kernels/place_chain.py, under the interpreter
on the CPU) equal their torch references, and both place each sequence as the plain-Python
reference says (`verifier.chain.chain_inputs_reference`): the first outcome with the round's
accepted drafts and bonus, the first where none matches (as the plain round, the round's bonus
first and no drafts, where the hint runs misses plain); page sizes 1, 4 and 16; results padded
past the batch (a CUDA graph's); the wrappers refuse what they cannot run."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specsplit.kernels import place_chain
from specsplit.kernels.place_chain import (
    place_accept,
    place_accept_reference,
    place_forward,
    place_forward_reference,
)
from specsplit.kernels.triton_jit import jit, runtime_params
from specsplit.messages import AheadTree, NextTrees, VerifyInput
from specsplit.tree import DraftTree
from verifier.accept_layout import page_window
from verifier.chain import Chain, chain_inputs, chain_inputs_reference, outcome_index

pytest.importorskip("triton")


def _case(
    seed: int, page_size: int
) -> tuple[Chain, list[list[int]], list[VerifyInput], list[NextTrees], dict[str, torch.Tensor]]:
    """A round r of B chains of N nodes with random results (B + 2 rows: a graph's padding),
    hints with random outcomes (some the one that came), the chained round's reference inputs
    as the host builds them (positions past a reference prefix) and its page tables."""
    rng = random.Random(seed)
    b, n, q = rng.randint(1, 5), rng.randint(0, 4), rng.randint(1, 5)
    rounds, hints, rows = [], [], []
    for i in range(b):
        tree = DraftTree([rng.randrange(50) for _ in range(n)], list(range(-1, n - 1)))
        committed = rng.randint(0, 40)
        rounds.append(VerifyInput(f"s{i}", False, committed, [rng.randrange(50)], tree))
        accepted = rng.randint(0, n)
        bonus = rng.randrange(50)
        rows.append([accepted, bonus, *range(accepted), *[-1] * (n - accepted)])
        came = [*tree.tokens[:accepted], bonus]
        trees = []
        for _ in range(rng.randint(1, 4)):
            length = rng.randint(1, n + 1)
            tokens = came if rng.random() < 0.4 else [rng.randrange(50) for _ in range(length)]
            nxt = DraftTree([rng.randrange(50) for _ in range(q - 1)], list(range(-1, q - 2)))
            trees.append(AheadTree(tokens, nxt))
        hints.append(NextTrees(f"s{i}", committed + 1, trees, plain=rng.random() < 0.5))
    num_pages = -(-(40 + 1 + 2 * n + q) // page_size) + 1
    table = np.array([rng.sample(range(500), num_pages) for _ in range(b)], dtype=np.int32)
    packed = torch.tensor([*rows, *[[7] * (2 + n)] * 2], dtype=torch.int64)
    chain = chain_inputs(packed, rounds, hints, table, page_size)
    # the forward's inputs as built for a reference prefix of 50: offsets 0, then depths
    offsets = torch.tensor([0, *range(1, q)], dtype=torch.int64)
    buffers = {
        "input_ids": torch.full((b * q + 3,), -5, dtype=torch.int64),
        "positions": (50 + offsets).repeat(b).tolist() + [0, 0, 0],
        "slot_mapping": torch.full((b * q + 3,), -5, dtype=torch.int64),
        "kv_lens": torch.full((b + 1,), 50 + q, dtype=torch.int32),
        "prefix_lens": torch.full((b + 1,), 50, dtype=torch.int32),
    }
    buffers["positions"] = torch.tensor(buffers["positions"], dtype=torch.int64)
    return chain, rows, rounds, hints, buffers


def _forward(chain: Chain, buffers: dict[str, torch.Tensor], kernel: bool) -> None:
    place = place_forward if kernel else place_forward_reference
    place(
        chain.packed, chain.bases, chain.keys, chain.next_tokens, chain.plain, chain.table,
        chain.page_size, buffers["input_ids"], buffers["positions"], buffers["slot_mapping"],
        buffers["kv_lens"], buffers["prefix_lens"], chain.committed, chain.tokens, chain.placed,
    )  # fmt: skip


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_the_kernels_place_each_outcome_as_the_references_do(page_size: int) -> None:
    plain_misses = 0
    for seed in range(12):
        chain, rows, rounds, hints, buffers = _case(seed, page_size)
        kernel_buffers = {k: v.clone() for k, v in buffers.items()}
        written = {name: getattr(chain, name).clone() for name in ("committed", "tokens", "placed")}
        kernel_chain = Chain(**{**chain.__dict__, **written})
        _forward(chain, buffers, kernel=False)
        _forward(kernel_chain, kernel_buffers, kernel=True)
        for name in buffers:
            assert torch.equal(kernel_buffers[name], buffers[name]), name
        for name in written:
            assert torch.equal(getattr(kernel_chain, name), getattr(chain, name)), name
        committed, tokens = chain_inputs_reference(rows, rounds, hints)
        assert chain.committed.tolist() == committed and chain.tokens.tolist() == tokens
        as_plain = [
            hint.plain and outcome_index(hint, row[0], row[1]) is None
            for hint, row in zip(hints, rows, strict=True)
        ]
        plain_misses += sum(as_plain)
        for i, plain in enumerate(as_plain):  # a miss placed plain: the round's own bonus first
            index = outcome_index(hints[i], rows[i][0], rows[i][1])
            assert chain.placed[i].item() == (-1 if plain else index or 0)
            if plain:
                assert tokens[i][0] == rows[i][1]
        b, q = chain.tokens.shape
        for i in range(b):  # positions keep their offsets; slots through the page table
            expected = [committed[i], *(committed[i] + d for d in range(1, q))]
            assert buffers["positions"][i * q : (i + 1) * q].tolist() == expected
            slots = [
                int(chain.table[i, s // page_size]) * page_size + s % page_size
                for s in range(committed[i], committed[i] + q)
            ]
            assert buffers["slot_mapping"][i * q : (i + 1) * q].tolist() == slots
        assert buffers["prefix_lens"][:b].tolist() == committed
        assert buffers["kv_lens"][:b].tolist() == [c + q for c in committed]
        assert buffers["input_ids"][b * q :].tolist() == [-5] * 3  # past the batch: untouched
        # the acceptance's draft tokens and page window
        width, pages = max(q - 1, 1) + 1, 3
        draft = torch.full((b + 2, width), -3, dtype=torch.int64)
        base = torch.full((b + 2,), -3, dtype=torch.int64)
        window = torch.full((b + 2, pages), -3, dtype=torch.int64)
        # the kernel's as a Layout's parts: views of one flat buffer, at an odd offset
        flat = torch.full((1 + draft.numel() + base.numel() + window.numel(),), -3)
        got = [
            piece.view(t.shape)
            for piece, t in zip(
                flat[1:].split([t.numel() for t in (draft, base, window)]),
                (draft, base, window),
                strict=True,
            )
        ]
        place_accept_reference(
            chain.committed, chain.tokens, chain.placed, chain.table, page_size, draft, base,
            window,
        )  # fmt: skip
        place_accept(
            kernel_chain.committed, kernel_chain.tokens, kernel_chain.placed, kernel_chain.table,
            page_size, *got,
        )  # fmt: skip
        assert all(torch.equal(g, w) for g, w in zip(got, (draft, base, window), strict=True))
        drafts = [
            [-1] * (q - 1) if plain else t[1:] for t, plain in zip(tokens, as_plain, strict=True)
        ]
        assert draft[:b, : q - 1].tolist() == drafts
        table, starts = chain.table.numpy(), np.array(committed) + 1
        want_window, want_base = page_window(table, starts, pages, page_size)
        assert window[:b].tolist() == want_window.tolist()
        assert base[:b].tolist() == want_base.tolist()
        assert draft[b:].tolist() == [[-3] * width] * 2  # padding rows: untouched
    assert plain_misses > 3  # (the cases hold misses placed plain)


@pytest.mark.usefixtures("triton_interpreter")
def test_the_wrappers_refuse_what_they_cannot_run() -> None:
    chain, _, _, _, buffers = _case(3, 4)
    short = {**buffers, "input_ids": buffers["input_ids"][:1]}
    with pytest.raises(ValueError, match="fewer than"):
        _forward(chain, short, kernel=True)
    wrong = {**buffers, "kv_lens": buffers["kv_lens"].to(torch.int64)}
    with pytest.raises(ValueError, match="int32"):
        _forward(chain, wrong, kernel=True)
    draft = torch.zeros(8, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="int64"):
        place_accept(
            chain.committed, chain.tokens, chain.placed, chain.table, 4, draft, draft[:, 0], draft
        )


def test_the_kernels_compile_once_for_every_offset_and_count() -> None:
    """No runtime argument gets a variant per value or per pointer alignment (a Layout's parts
    sit at offsets that vary with the graph bucket; a compile would stall a chained round for
    hundreds of milliseconds), and the block sizes have floors that the warm-up compiles."""
    import triton

    if triton.knobs.runtime.interpret:
        pytest.skip("TRITON_INTERPRET is set in this process")
    for kernel in (place_chain._place_forward_kernel, place_chain._place_accept_kernel):
        params = {p.name: p for p in jit(kernel, generic=True).params}
        runtime = runtime_params(kernel)
        assert {"Q", "table_ptr", "page_size"} <= set(runtime)
        assert not any("BLOCK" in name for name in runtime)
        for name, param in params.items():
            assert param.do_not_specialize == (name in runtime), name
            assert param.do_not_specialize_on_alignment == (name in runtime), name
    assert place_chain._block(4, place_chain.BLOCK_Q) == place_chain._block(17, 32) == 32
    assert place_chain._block(33, place_chain.BLOCK_Q) == 64


def test_the_kernels_run_on_the_cpu_only_interpreted() -> None:
    import triton

    if triton.knobs.runtime.interpret:
        pytest.skip("TRITON_INTERPRET is set in this process")
    chain, _, _, _, buffers = _case(1, 4)
    with pytest.raises(ValueError, match="CUDA"):
        _forward(chain, buffers, kernel=True)


def test_chain_inputs_lay_out_each_hints_outcomes_padded_with_no_outcome() -> None:
    """The hints' tables as they cross: per sequence its base, each outcome's key and tokens
    (bonus, then its tree), -1 keys and 0 tokens past its outcomes, its plain flag, its page
    table as int64."""
    nxt = DraftTree([40, 41], [-1, 0])
    rounds = [
        VerifyInput("a", False, 10, [1], DraftTree([5, 6], [-1, 0])),
        VerifyInput("b", False, 20, [2, 3], DraftTree([7, 8], [-1, 0])),
    ]
    hints = [
        NextTrees("a", 11, [AheadTree([9], nxt), AheadTree([5, 6, 12], nxt)], plain=True),
        NextTrees("b", 22, [AheadTree([7, 13], nxt)]),
    ]
    table = np.array([[3, 4], [5, 6]], dtype=np.int32)
    chain = chain_inputs(torch.zeros(2, 4, dtype=torch.int64), rounds, hints, table, 16)
    assert chain.bases.tolist() == [11, 22]
    key = place_chain.outcome_keys
    assert chain.keys.tolist() == [[key(0, 9), key(2, 12)], [key(1, 13), -1]]
    assert chain.next_tokens.tolist() == [
        [[9, 40, 41], [12, 40, 41]],
        [[13, 40, 41], [0, 0, 0]],
    ]
    assert chain.plain.tolist() == [1, 0]
    assert chain.table.dtype == torch.int64 and chain.table.tolist() == [[3, 4], [5, 6]]
