"""What a device expansion (drafter/expansion.py) is keyed by and reads: its keys (`Shape`, a
draft round's expansion; `Ahead`, draft-ahead's), what it hands back (`Candidates`) and takes in
(`PoolRows`), the tensors each key's runs read that depend on the key and rows alone, made once
outside a graph (`GrowConstants`, `CatchUpConstants`, `AheadConstants`), and one run's inputs
and outputs (`ExpansionInputs`: a CUDA graph's fixed buffers, or an eager run's tensors)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specsplit.tree import DRAFT_SUPPORT, DraftProbs


@dataclass
class PoolRows:
    """Host rows for a proposer's row pool (an EAGLE head's target features at their KV slots):
    [n_i, width] CPU parts of the pool's dtype, a sequence's each, and each part's slots."""

    parts: list[torch.Tensor]
    slots: list[list[int]]

    def fit(self, q: int) -> bool:
        """Whether every part has at most q rows (what a catch-up of q entries a sequence
        carries)."""
        return all(part.shape[0] <= q for part in self.parts)


@dataclass
class RuleRun:
    """A run's logit rules (a key with `rules`): each row's slot in the proposer's RuleTables,
    and the tables' pending count changes [2, n] int32 the run counts in first
    (drafter/draft_rules.py; at most DELTAS_PER_ROW a row)."""

    slots: list[int]
    deltas: np.ndarray


# count changes a run of a key with rules carries per row (more: counted in before the run)
DELTAS_PER_ROW = 8


@dataclass(frozen=True)
class Shape:
    topk: int
    num_steps: int
    sampled: bool = False  # a sampled chain (topk 1): draws from inputs' params and uniforms
    # q > 0: first every sequence's last q entries up to its root (0: the roots' logits and
    # outputs are given)
    catch_up: int = 0
    # every step's logits bent by its sequence's logit rules (`ExpansionInputs.rule_slots`,
    # drafter/draft_rules.py)
    rules: bool = False

    @property
    def num_candidates(self) -> int:
        return self.topk + (self.num_steps - 1) * self.topk * self.topk


@dataclass
class Candidates:
    """One sequence's expansion: every candidate's token and parent (-1 = the root), and the
    candidates best first (score descending, ties to the lower index: a parent before its
    children)."""

    tokens: list[int]
    parents: list[int]
    order: list[int]
    draft_probs: DraftProbs | None = None  # a sampled chain's cut distribution per node


@dataclass(frozen=True)
class Ahead:
    """Draft-ahead's expansion (`DeviceExpansion.expand_ahead`): the chain of `chain_len` nodes
    being verified, `guesses` bonus tokens per accept length, a tree of `shape` for each; with
    `catch_up` = q, first every sequence's last q entries up to its root (0: the roots' logits
    and outputs are given)."""

    chain_len: int
    guesses: int
    shape: Shape
    catch_up: int = 0

    @property
    def num_outcomes(self) -> int:
        return (self.chain_len + 1) * self.guesses

    @property
    def width(self) -> int:
        """Storage past the root: the chain, then per outcome its bonus and candidates."""
        return self.chain_len + self.num_outcomes * (1 + self.shape.num_candidates)


class GrowConstants:
    """What `_grow` reads that depends on its shape, rows and mask width alone, made once with
    a graph's inputs (outside the graph: no kernel each replay) or per eager run."""

    def __init__(self, shape: Shape, rows: int, width: int, device: torch.device) -> None:
        topk, steps = shape.topk, shape.num_steps
        self.cu = torch.arange(0, rows * topk + 1, topk, dtype=torch.int32, device=device)
        self.every_row = torch.arange(rows * topk, device=device)
        self.frontier = torch.arange(topk, device=device).expand(rows, topk)  # [R, k] ids
        # a chain's (`_grow_chain`): its forwards' nodes [S - 1, 1], the mask columns [width],
        # every candidate's parent and the best-first order (each node's score is 0) [R, S]
        self.chain_nodes = torch.arange(max(steps - 1, 0), device=device)[:, None]
        self.cols = torch.arange(width, device=device)
        self.chain_parents = (torch.arange(steps, device=device) - 1).expand(rows, steps)
        self.chain_order = torch.arange(steps, device=device).expand(rows, steps)


class CatchUpConstants:
    """What a catch-up of q entries a row (`DeviceExpansion._roots`) reads that depends on q
    and the rows alone, made once (as GrowConstants)."""

    def __init__(self, q: int, bs: int, device: torch.device) -> None:
        rows = torch.arange(bs + 1, dtype=torch.int32, device=device)
        self.q = q
        self.cols = torch.arange(q, device=device)
        self.cu = rows * q  # cu_seqlens
        self.last = rows[1:].long() * q - 1  # each row's last entry: its root


class AheadConstants:
    """What draft-ahead's steps (`_ahead_body`) read that depends on its key and rows alone,
    made once (as GrowConstants). Outcome row r = (b, k, j) of B * (L + 1) * g."""

    def __init__(self, key: Ahead, bs: int, device: torch.device) -> None:
        chain_len, n, num = key.chain_len, key.shape.num_candidates, key.num_outcomes
        rows = bs * num
        cols = torch.arange(key.width, device=device)
        self.one = torch.arange(bs + 1, dtype=torch.int32, device=device)  # cu_seqlens, 1 a row
        self.every_row = torch.arange(bs, device=device)
        # chain node t sees the chain up to itself: [L] masks of [B, 1, width]
        self.chain_masks = [(cols <= t).expand(bs, 1, key.width) for t in range(chain_len)]
        self.chain_cols = torch.arange(chain_len, device=device)[:, None]  # [L, 1] node t
        self.chain_ends = (self.chain_cols + 1).to(torch.int32)  # [L, 1] entries up to it
        per_row = torch.arange(chain_len + 1, device=device).repeat_interleave(key.guesses)
        self.k_of = per_row.repeat(bs)  # [R] each outcome's accept length
        o_of = torch.arange(num, device=device).repeat(bs)
        self.bonus_col = chain_len + o_of * (1 + n)  # [R] each outcome's bonus column
        # [R] each outcome's sequence, and its row of the chain's [B * (L + 1)] outputs
        self.seq_of = torch.arange(bs, device=device).repeat_interleave(num)
        self.node_of = self.seq_of * (chain_len + 1) + self.k_of
        # [R, width]: an outcome's bonus sees the k chain nodes it follows and itself
        self.visible = (cols[None, :] < self.k_of[:, None]) | (
            cols[None, :] == self.bonus_col[:, None]
        )
        self.cu_rows = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(rows, device=device)
        self.grow = GrowConstants(key.shape, rows, key.width, device)


class ExpansionInputs:
    """What one expansion reads and writes, for a batch of `bs` rows: the fixed buffers of a
    CUDA graph, or one eager run's tensors. Draft-ahead's (`ahead`) also read each row's chain
    (in `meta`) and write every outcome's candidates, then the bonus tokens, into `out`."""

    def __init__(
        self,
        key: Shape | Ahead,
        bs: int,
        vocab: int,
        scored: int,  # the width of the forwards' logits (`DeviceExpansion.scored_ids`)
        feature: tuple[int, torch.dtype] | None,
        max_pages: int,
        device: torch.device,
        new_rows: torch.Tensor | None = None,  # [bs * catch_up, width]: the pool's new rows
    ) -> None:
        shape = key.shape if isinstance(key, Ahead) else key
        chain_len = key.chain_len if isinstance(key, Ahead) else 0
        catch_up = key.catch_up
        n = shape.num_candidates
        self.bs = bs
        # the roots' logits and outputs, unless the run computes them (a catch-up)
        roots = bs if not catch_up else 0
        self.logits = torch.zeros(roots, scored, dtype=torch.float32, device=device)
        self.features = (
            None
            if feature is None
            else torch.zeros(roots, feature[0], dtype=feature[1], device=device)
        )
        # a catch-up's new pool rows, written at their slots before it reads the pool (a
        # sequence's at most q; the rest at the scratch page's first slot), or None
        self.new_rows = new_rows if catch_up else None
        self.row_slots = catch_up if self.new_rows is not None else 0  # a row's, in meta
        # int32, crossing from the host in one copy: with `rules`, each row's slot in the
        # proposer's RuleTables [bs] (padding rows: 0, unbent; else None) and the tables' count
        # changes [2, DELTAS_PER_ROW * bs] (`RuleRun.deltas`, zero after); then `meta`: every
        # row's base [bs], the block table [bs, max_pages], the chains [bs, L], the catch-ups'
        # input tokens [bs, q], the new pool rows' slots [bs, q]
        self.rule_cols = bs if shape.rules else 0
        self.meta_start = self.rule_cols * (1 + 2 * DELTAS_PER_ROW)
        self.crossing = torch.zeros(
            self.meta_start + bs * (1 + max_pages + chain_len + catch_up + self.row_slots),
            dtype=torch.int32,
            device=device,
        )
        self.rule_slots = self.crossing[: self.rule_cols] if shape.rules else None
        self.rule_deltas = (
            self.crossing[self.rule_cols : self.meta_start].view(2, -1) if shape.rules else None
        )
        self.meta = self.crossing[self.meta_start :]
        if isinstance(key, Ahead):
            rows = bs * key.num_outcomes
            size = rows * 3 * n + bs * (chain_len + 1) * key.guesses
        else:
            rows = bs
            size = bs * 3 * n
        # a sampled chain's rows, a sequence's (each of its outcomes' chains draws at the same
        # uniforms): temperature, top_p, top_k, then a uniform per step
        steps = shape.num_steps if shape.sampled else 0
        self.sampling = torch.ones(bs, 3 + steps, dtype=torch.float32, device=device)
        self.support = min(DRAFT_SUPPORT, vocab)
        size += rows * steps * self.support  # each chain's steps' supports' tokens
        self.probs = torch.zeros(rows * steps * self.support, dtype=torch.float32, device=device)
        # tokens, parents, order (draft-ahead's: then the bonus tokens), then a sampled chain's
        # supports' tokens
        self.out = torch.zeros(size, dtype=torch.int64, device=device)
        self.ahead = AheadConstants(key, bs, device) if isinstance(key, Ahead) else None
        self.catch_up = CatchUpConstants(catch_up, bs, device) if catch_up else None
        self.grow = (
            self.ahead.grow
            if self.ahead is not None
            else GrowConstants(shape, bs, shape.num_candidates, device)
        )
