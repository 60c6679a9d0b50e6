"""Batched greedy acceptance and accepted-path KV compaction against the per-sequence references
(`accept_greedy`, and the verifier's commit of the accepted path's K/V): exact equality on
random trees, chains and padded batches; no host sync; the same ops whatever the data."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specsplit.acceptance import accept_greedy
from specsplit.kernels.accept import (
    BatchedAccept,
    accept_greedy_batched,
    accept_greedy_from_logits,
    accepted_kv_moves,
    compact_accepted_kv,
)
from specsplit.kv_cache import SeqKV
from specsplit.tree import DraftTree

VOCAB = 32
MAX_COMMITTED = 40  # kv_committed_len of a case's sequences is drawn from [0, MAX_COMMITTED]
MAX_PENDING = 3
GARBAGE_PAGES = (-7, 10**6, 2**40)  # block-table entries no sequence owns


# -- trees and target outputs -----------------------------------------------------------------


@dataclass
class TreeSpec:
    num_nodes: int
    topk: int
    max_depth: int


def random_tree(rng: random.Random, spec: TreeSpec) -> DraftTree:
    """Up to spec.num_nodes nodes, parents first, <= topk children each, siblings distinct."""
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    children: dict[int, list[int]] = {-1: []}
    for node in range(spec.num_nodes):
        open_nodes = [p for p in [-1, *range(node)] if len(children[p]) < spec.topk]
        open_nodes = [p for p in open_nodes if p < 0 or depths[p] < spec.max_depth]
        if not open_nodes:
            break
        parent = rng.choice(open_nodes)
        token = rng.choice([t for t in range(VOCAB) if t not in children[parent]])
        tokens.append(token)
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        children[parent].append(token)
        children[node] = []
    tree = DraftTree(tokens=tokens, parents=parents)
    tree.validate(VOCAB)
    return tree


def argmax_rows(rng: random.Random, tree: DraftTree, p_follow: float) -> list[int]:
    """[n + 1] target argmax per row: with probability p_follow a child's token (the walk goes
    on), else any token (it usually stops there)."""
    rows = []
    for node in range(-1, len(tree)):
        kids = tree.children(node)
        if kids and rng.random() < p_follow:
            rows.append(tree.tokens[rng.choice(kids)])
        else:
            rows.append(rng.randrange(VOCAB))
    return rows


def logits_for(rows: list[int], gen: torch.Generator) -> torch.Tensor:
    """[len(rows), VOCAB] logits whose row i peaks (uniquely) at rows[i]."""
    logits = torch.rand(len(rows), VOCAB, generator=gen)  # [0, 1)
    logits[torch.arange(len(rows)), torch.tensor(rows, dtype=torch.int64)] = 2.0
    return logits


@dataclass
class Batch:
    trees: list[DraftTree | None]  # None: a padding sequence (no tree, garbage everywhere)
    target_logits: torch.Tensor  # [B, N + 1, VOCAB]
    draft_tokens: torch.Tensor  # [B, N] int64
    parents: torch.Tensor  # [B, N] int64, padding nodes -2

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.trees,
            self.target_logits.to(device),
            self.draft_tokens.to(device),
            self.parents.to(device),
        )


def make_batch(seed: int, specs: list[TreeSpec | None], width: int, p_follow: float = 0.8) -> Batch:
    """Trees padded to `width` nodes; padding nodes get random tokens, parent -2 and random
    target rows (which must never be read)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = len(specs)
    target_logits = torch.rand(batch, width + 1, VOCAB, generator=gen)
    draft_tokens = torch.randint(0, VOCAB, (batch, width), generator=gen)
    parents = torch.full((batch, width), -2, dtype=torch.int64)
    trees: list[DraftTree | None] = []
    for b, spec in enumerate(specs):
        if spec is None:
            trees.append(None)
            continue
        tree = random_tree(rng, spec)
        n = len(tree)
        assert n <= width, (n, width)
        target_logits[b, : n + 1] = logits_for(argmax_rows(rng, tree, p_follow), gen)
        draft_tokens[b, :n] = torch.tensor(tree.tokens, dtype=torch.int64)
        parents[b, :n] = torch.tensor(tree.parents, dtype=torch.int64)
        trees.append(tree)
    return Batch(trees, target_logits, draft_tokens, parents)


def check_accept(batch: Batch, result: BatchedAccept) -> list[int]:
    """Assert `result` equals accept_greedy per sequence; return num_accepted_drafts."""
    width = batch.draft_tokens.shape[1]
    num_accepted = result.num_accepted_drafts.cpu()
    accepted_nodes = result.accepted_nodes.cpu()
    bonus_tokens = result.bonus_tokens.cpu()
    logits = batch.target_logits.cpu()
    for b, tree in enumerate(batch.trees):
        if tree is None:
            tree = DraftTree()
        ref = accept_greedy(tree, logits[b, : len(tree) + 1])
        expected_nodes = ref.accepted_nodes + [-1] * (width - ref.num_accepted_drafts)
        assert int(num_accepted[b]) == ref.num_accepted_drafts, b
        assert accepted_nodes[b].tolist() == expected_nodes, b
        assert int(bonus_tokens[b]) == ref.bonus_token, b
    assert result.num_accepted_tokens.cpu().tolist() == [n + 1 for n in num_accepted.tolist()]
    return num_accepted.tolist()


def run_accept(batch: Batch) -> BatchedAccept:
    return accept_greedy_from_logits(batch.target_logits, batch.draft_tokens, batch.parents)


# -- KV compaction ----------------------------------------------------------------------------


@dataclass
class KVCase:
    batch: Batch
    seqs: list[SeqKV | None]  # None: padding sequence
    num_pending: list[int]
    base: torch.Tensor  # [B] int64 storage index of tree node 0
    block_table: torch.Tensor  # [B, max_pages] int32, unused entries garbage
    kv_data: torch.Tensor  # [L, 2, num_slots, H, D], a distinct value per element
    page_size: int
    scratch_slot: int

    def to(self, device: torch.device | str) -> KVCase:
        return KVCase(
            self.batch.to(device),
            self.seqs,
            self.num_pending,
            self.base.to(device),
            self.block_table.to(device),
            self.kv_data.to(device),
            self.page_size,
            self.scratch_slot,
        )


def kv_shape(batch_size: int, width: int, page_size: int) -> tuple[int, int]:
    """(max_pages, num_pages) that fit any case of this size: fixed, for CUDA-graph replays."""
    max_pages = -(-(MAX_COMMITTED + MAX_PENDING + width) // page_size)
    return max_pages, batch_size * max_pages + 2  # + a scratch page + one nobody owns


def make_kv_case(
    seed: int, specs: list[TreeSpec | None], width: int, page_size: int, p_follow: float = 0.8
) -> KVCase:
    rng = random.Random(seed + 1_000)
    batch = make_batch(seed, specs, width, p_follow)
    max_pages, num_pages = kv_shape(len(specs), width, page_size)
    free_pages = list(range(num_pages - 1))  # the last page holds the scratch slot
    rng.shuffle(free_pages)
    scratch_slot = num_pages * page_size - 1  # fixed for a shape, like a captured graph's
    block_table = torch.tensor(
        [[rng.choice(GARBAGE_PAGES) for _ in range(max_pages)] for _ in specs], dtype=torch.int64
    )
    base = torch.tensor([rng.choice((-3, 10**9)) for _ in specs], dtype=torch.int64)
    seqs: list[SeqKV | None] = []
    num_pending: list[int] = []
    for b, tree in enumerate(batch.trees):
        if tree is None:
            seqs.append(None)
            num_pending.append(0)
            continue
        seq = SeqKV(page_size=page_size, kv_committed_len=rng.randint(0, MAX_COMMITTED))
        pending = rng.randint(1, MAX_PENDING)
        length = seq.kv_committed_len + pending + len(tree)
        seq.page_table = [free_pages.pop() for _ in range(-(-length // page_size))]
        block_table[b, : len(seq.page_table)] = torch.tensor(seq.page_table)
        base[b] = seq.kv_committed_len + pending
        seqs.append(seq)
        num_pending.append(pending)
    kv_data = torch.arange(2 * 2 * num_pages * page_size * 2 * 3, dtype=torch.float32)
    kv_data = kv_data.reshape(2, 2, num_pages * page_size, 2, 3)  # L=2, H=2, D=3
    return KVCase(
        batch,
        seqs,
        num_pending,
        base,
        block_table.to(torch.int32),
        kv_data,
        page_size,
        scratch_slot,
    )


def reference_commit(case: KVCase) -> torch.Tensor:
    """kv_data after the verifier's commit, sequence by sequence (`VerifierEngine._commit`): the
    node at depth 1 + d from storage base + node to base + d, gathered before scattered."""
    kv_data = case.kv_data.cpu().clone()
    logits = case.batch.target_logits.cpu()
    for b, (tree, seq) in enumerate(zip(case.batch.trees, case.seqs, strict=True)):
        if tree is None or seq is None:
            continue
        accepted = accept_greedy(tree, logits[b, : len(tree) + 1]).accepted_nodes
        base = seq.kv_committed_len + case.num_pending[b]
        assert base + len(tree) <= seq.kv_allocated_len
        src = storage_slots(seq, [base + node for node in accepted])
        dst = storage_slots(seq, range(base, base + len(accepted)))
        kv_data[:, :, dst] = kv_data[:, :, src]
    return kv_data


def storage_slots(seq: SeqKV, storage: Iterable[int]) -> torch.Tensor:
    """int64 cache slots of a sequence's storage indices, straight from its page table."""
    size, table = seq.page_size, seq.page_table
    return torch.tensor([table[i // size] * size + i % size for i in storage], dtype=torch.int64)


def run_commit(case: KVCase) -> BatchedAccept:
    """Batched acceptance, move computation and compaction, all on the case's device."""
    result = run_accept(case.batch)
    src, dst = accepted_kv_moves(
        case.base,
        result.accepted_nodes,
        result.num_accepted_drafts,
        case.block_table,
        case.page_size,
        case.scratch_slot,
    )
    compact_accepted_kv(case.kv_data, src, dst)
    return result


def check_commit(case: KVCase, expected: torch.Tensor) -> None:
    """Every slot but the scratch slot holds what the per-sequence commit left there."""
    keep = torch.ones(expected.shape[2], dtype=torch.bool)
    keep[case.scratch_slot] = False
    assert torch.equal(case.kv_data.cpu()[:, :, keep], expected[:, :, keep])


def mixed_specs(rng: random.Random, batch_size: int, width: int) -> list[TreeSpec | None]:
    """Trees, chains, leaf-only trees, empty trees and padding sequences of varied sizes."""
    specs: list[TreeSpec | None] = []
    for _ in range(batch_size):
        kind = rng.choice(("tree", "tree", "chain", "leaves", "empty", "padding"))
        n = rng.randint(1, width)
        if kind == "tree":
            specs.append(TreeSpec(n, rng.randint(1, 4), rng.randint(1, width)))
        elif kind == "chain":
            specs.append(TreeSpec(n, 1, n))
        elif kind == "leaves":
            specs.append(TreeSpec(n, n, 1))
        elif kind == "empty":
            specs.append(TreeSpec(0, 1, 1))
        else:
            specs.append(None)
    return specs


# -- acceptance -------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [1, 2, 3, 5, 8, 16])
def test_random_trees_match_reference(width: int) -> None:
    deepest = 0
    for seed in range(40):
        rng = random.Random(seed)
        specs: list[TreeSpec | None] = [
            TreeSpec(width, rng.randint(1, 4), rng.randint(1, width)) for _ in range(6)
        ]
        batch = make_batch(seed, specs, width)
        deepest = max(deepest, *check_accept(batch, run_accept(batch)))
    assert deepest >= min(width, 3), "acceptance never went deep: the cases are too easy"


@pytest.mark.parametrize("width", [1, 4, 16])
def test_random_chains_match_reference(width: int) -> None:
    for seed in range(40):
        batch = make_batch(seed, [TreeSpec(width, 1, width)] * 4, width)
        check_accept(batch, run_accept(batch))


def test_mixed_sizes_with_padding_nodes_match_reference() -> None:
    for seed in range(60):
        rng = random.Random(seed)
        width = rng.randint(1, 16)
        batch = make_batch(seed, mixed_specs(rng, 8, width), width)
        check_accept(batch, run_accept(batch))


def test_all_accepted_chain() -> None:
    batch = make_batch(0, [TreeSpec(6, 1, 6)] * 3, 6, p_follow=1.0)
    assert check_accept(batch, run_accept(batch)) == [6, 6, 6]


def test_early_mismatch() -> None:
    # chain 3 -> 5 -> 7; the target wants 6 after 3, the later rows would match but are unused
    target_argmax = torch.tensor([[3, 6, 7, 42]])
    result = accept_greedy_batched(
        target_argmax, torch.tensor([[3, 5, 7]]), torch.tensor([[-1, 0, 1]])
    )
    assert result.num_accepted_drafts.tolist() == [1]
    assert result.accepted_nodes.tolist() == [[0, -1, -1]]
    assert result.bonus_tokens.tolist() == [6]


def test_none_accepted() -> None:
    batch = make_batch(1, [TreeSpec(8, 3, 4)] * 4, 8, p_follow=0.0)
    for b, tree in enumerate(batch.trees):  # the root's argmax is no child's token
        assert tree is not None
        batch.target_logits[b, 0, [tree.tokens[c] for c in tree.children(-1)]] = -1.0
    assert check_accept(batch, run_accept(batch)) == [0, 0, 0, 0]


def test_child_of_the_current_node_only() -> None:
    # node 2 (under 0) and node 5 (under 1) both carry 23; the walk goes 1 -> 5, never to 2
    tokens = [10, 11, 23, 21, 22, 23]
    parents = [-1, -1, 0, 0, 1, 1]
    target_argmax = torch.tensor([[11, 23, 23, 0, 0, 0, 9]])
    result = accept_greedy_batched(target_argmax, torch.tensor([tokens]), torch.tensor([parents]))
    assert result.accepted_nodes.tolist() == [[1, 5, -1, -1, -1, -1]]
    assert result.bonus_tokens.tolist() == [9]


def test_leaf_only_trees() -> None:
    for seed in range(20):
        batch = make_batch(seed, [TreeSpec(n, n, 1) for n in (1, 4, 9, 16)], 16)
        assert max(check_accept(batch, run_accept(batch))) <= 1


def test_zero_width_rows() -> None:
    target_argmax = torch.tensor([[5], [17], [0]])
    empty = torch.zeros(3, 0, dtype=torch.int64)
    result = accept_greedy_batched(target_argmax, empty, empty)
    assert result.num_accepted_drafts.tolist() == [0, 0, 0]
    assert tuple(result.accepted_nodes.shape) == (3, 0)
    assert result.bonus_tokens.tolist() == [5, 17, 0]


def test_padding_nodes_are_never_accepted() -> None:
    # node 1 is padding (parent -2) although its token matches the root's argmax
    result = accept_greedy_batched(
        torch.tensor([[4, 8, 9]]), torch.tensor([[3, 4]]), torch.tensor([[-1, -2]])
    )
    assert result.num_accepted_drafts.tolist() == [0]
    assert result.bonus_tokens.tolist() == [4]


def test_rejects_bad_shapes_and_dtypes() -> None:
    tokens = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="N \\+ 1"):
        accept_greedy_batched(torch.zeros(2, 3, dtype=torch.int64), tokens, tokens)
    with pytest.raises(ValueError, match="int64"):
        accept_greedy_batched(torch.zeros(2, 4, dtype=torch.int32), tokens, tokens)
    with pytest.raises(ValueError, match="kv_data"):
        compact_accepted_kv(torch.zeros(2, 3, 4, 1, 1), tokens[0], tokens[0])


# -- no host sync, fixed ops ------------------------------------------------------------------


def test_no_host_sync_on_meta_tensors() -> None:
    # meta tensors carry no data: .item(), .tolist(), bool(), nonzero and boolean-mask indexing
    # all raise on them, so a pass here means no step reads data back to the host.
    with pytest.raises(RuntimeError):
        torch.zeros(1, device="meta").item()
    case = make_kv_case(3, mixed_specs(random.Random(3), 6, 8), 8, page_size=16).to("meta")
    result = run_commit(case)
    assert result.accepted_nodes.device.type == "meta"
    assert tuple(result.accepted_nodes.shape) == (6, 8)


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_same_ops_whatever_the_data() -> None:
    """A fixed op sequence for a given shape: what a CUDA graph replays."""
    traces = []
    for seed, p_follow in ((0, 0.0), (1, 1.0), (2, 0.7)):
        specs = mixed_specs(random.Random(seed), 6, 12)
        case = make_kv_case(seed, specs, 12, page_size=16, p_follow=p_follow)
        with _OpRecorder() as recorder:
            run_commit(case)
        traces.append(recorder.ops)
    assert traces[0] == traces[1] == traces[2]


# -- KV compaction ----------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_compaction_matches_per_sequence_commit(page_size: int) -> None:
    num_moved = 0
    for seed in range(30):
        rng = random.Random(seed)
        width = rng.randint(1, 16)
        case = make_kv_case(seed, mixed_specs(rng, 6, width), width, page_size)
        before = case.kv_data.clone()
        expected = reference_commit(case)
        check_accept(case.batch, run_commit(case))
        check_commit(case, expected)
        num_moved += int((case.kv_data != before).any(dim=(0, 1, 3, 4)).sum())
    assert num_moved > 30, "too few slots changed for the comparison to mean much"


@pytest.mark.parametrize("page_size", [1, 16])
def test_overlapping_moves_on_deep_trees(page_size: int) -> None:
    # wide trees accepted deep: node j at depth d moves from base + j to base + d - 1, and
    # sources of later depths are destinations of earlier ones
    for seed in range(20):
        case = make_kv_case(seed, [TreeSpec(16, 2, 16)] * 4, 16, page_size)
        expected = reference_commit(case)
        run_commit(case)
        check_commit(case, expected)


def test_padding_sequences_leave_kv_untouched() -> None:
    case = make_kv_case(5, [None, None, None], 8, page_size=16)
    before = case.kv_data.clone()
    result = run_commit(case)
    assert result.num_accepted_drafts.tolist() == [0, 0, 0]
    check_commit(case, before)


def test_padding_moves_go_scratch_to_scratch() -> None:
    case = make_kv_case(6, mixed_specs(random.Random(6), 8, 10), 10, page_size=1)
    result = run_accept(case.batch)
    src, dst = accepted_kv_moves(
        case.base,
        result.accepted_nodes,
        result.num_accepted_drafts,
        case.block_table,
        case.page_size,
        case.scratch_slot,
    )
    real = (torch.arange(10)[None, :] < result.num_accepted_drafts[:, None]).reshape(-1)
    assert torch.equal(src[~real], torch.full_like(src[~real], case.scratch_slot))
    assert torch.equal(dst[~real], torch.full_like(dst[~real], case.scratch_slot))
    real_dst = dst[real]
    assert len(set(real_dst.tolist())) == len(real_dst), "a destination is written twice"
    assert case.scratch_slot not in src[real].tolist() + real_dst.tolist()
