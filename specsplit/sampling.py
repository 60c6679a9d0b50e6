"""Sampling parameters and the target distribution they define (DESIGN.md §2).

Speculative decoding stays lossless only if the acceptance walk and plain target decoding draw
from the same distribution: temperature, then top-k, then top-p, renormalised (on logits the
verifier has bent first by the request's logit rules where it has any: specsplit/logit_rules.py,
bias, penalties, min_tokens and min_p). The verifier's
rounds, speculative and plain alike, build it with `target_probs_rows` (every row its own
params; the cut at one threshold a row, ties at it kept together); `target_probs`, the same
law with a sort's ties, is the per-sequence reference. Greedy (temperature 0) never builds a
distribution: it takes the argmax. `draw_from_cut` is the drafter's: a draft from its
distribution cut to a few hundred tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specsplit.kernels.cut_draw import cut_draw, cut_draw_reference, takes_kernel
from specsplit.kernels.nucleus import TOP_P_SLACK, cut_thresholds_rows

SEED_SPACE = 2**64  # a seed is in [0, SEED_SPACE)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    seed: int | None = None  # per-request generator seed; None = random

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the field when a parameter is out of range."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: must be finite and >= 0")
        if not 0.0 < self.top_p <= 1.0:  # also rejects nan
            raise ValueError(f"top_p = {self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}: must be >= 0 (0 = off)")
        if self.seed is not None and not 0 <= self.seed < SEED_SPACE:
            raise ValueError(f"seed = {self.seed}: must be in [0, 2**64) or unset")


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 probabilities after temperature, top-k, top-p.

    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (at least one
    token). Ties at a top-k / top-p boundary are broken by torch.topk / torch.sort order.
    """
    if params.greedy:
        raise ValueError("target_probs needs temperature > 0; greedy decoding takes the argmax")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    logits = logits.float() / params.temperature  # [N, V]
    vocab_size = logits.shape[-1]
    if 0 < params.top_k < vocab_size:
        top = logits.topk(params.top_k, dim=-1).indices  # [N, k]
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, True)  # exactly k
        logits = logits.masked_fill(~keep, -math.inf)
    probs = torch.softmax(logits, dim=-1)  # [N, V]
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # [N, V] each
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [N, V] exclusive cumsum
        keep_sorted = mass_before < params.top_p - TOP_P_SLACK
        keep_sorted[:, 0] = True  # the most likely token always survives
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)  # [N, V]
        probs = probs * keep
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def target_probs_rows(
    logits: torch.Tensor,  # [R, V]
    temperature: torch.Tensor,  # [R] float: 0 = greedy
    top_k: torch.Tensor,  # [R] int: 0 (or >= V) = off
    top_p: torch.Tensor,  # [R] float in (0, 1]: 1 = off
    filters: bool = True,
) -> torch.Tensor:
    """[R, V] float32: row r as `target_probs` gives it for row r's params (a greedy row: the
    one-hot of its argmax, lowest token id on ties). A fixed sequence of ops whatever the params
    (a CUDA graph captures it). `filters` False: no row has top-k or top-p, and no cut threshold
    is looked for.

    Top-k and top-p cut at one probability threshold a row (no sort of the vocabulary on a
    GPU: specsplit/kernels/nucleus.py); tokens tied at a boundary are kept or cut together,
    where target_probs breaks the tie by its sort's order."""
    if logits.dim() != 2 or any(t.shape != logits.shape[:1] for t in (temperature, top_k, top_p)):
        raise ValueError(
            f"logits [R, V] with temperature, top_k, top_p [R], got {tuple(logits.shape)}, "
            f"{tuple(temperature.shape)}, {tuple(top_k.shape)}, {tuple(top_p.shape)}"
        )
    greedy = temperature == 0
    x = logits.float() / torch.where(greedy, 1.0, temperature).float()[:, None]  # [R, V]
    probs = torch.softmax(x, dim=-1)
    if filters:  # each row's cut as one probability threshold (specsplit/kernels/nucleus.py)
        tau = cut_thresholds_rows(probs, top_k.long(), top_p.float())
        kept = probs * (probs >= tau[:, None])
        probs = kept / kept.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def draw_from_cut(
    logits: torch.Tensor,  # [R, V]
    params: torch.Tensor,  # [R, 3] float: temperature (> 0), top_p, top_k (0 = off)
    uniforms: torch.Tensor,  # [R] in [0, 1)
    support: int,
    tail: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft per row from the row's distribution (`target_probs` of its params) cut to its
    `support` likeliest tokens and renormalized, by inverse CDF at the row's uniform: (tokens
    [R] int64, the support's tokens [R, S] int64 and probabilities [R, S] float32, likeliest
    first, 0 past a top-k / top-p cut). `tail` > 0 cuts each row after its likeliest tokens
    holding 1 - tail of the mass too (as a top-p of 1 - tail where top-p is wider or off): a
    row of a peaked distribution keeps a few tokens, not `support`. The draft is exactly a draw
    from that distribution, so rejection sampling against it stays lossless (a cut of mass m
    lowers a node's acceptance by at most m). A fixed sequence of ops (a CUDA graph
    captures it), no sort of the vocabulary: top-p measures mass against the whole
    vocabulary's (or top-k's, where top-k <= support) normalizer; with a top-k wider than the
    support and top-p both set, against the whole vocabulary's, a little looser than
    target_probs' cut."""
    vocab_size = logits.shape[-1]
    support = min(support, vocab_size)
    x = logits.float() / params[:, 0].float()[:, None]
    values, tokens = x.topk(support, dim=-1)  # [R, S] each, likeliest first
    # the cut and the draw: one launch on a GPU (specsplit/kernels/cut_draw.py)
    draw = cut_draw if takes_kernel(values) else cut_draw_reference
    probs, pick = draw(values, torch.logsumexp(x, dim=-1), params, uniforms, vocab_size, tail)
    return tokens.gather(1, pick[:, None]).squeeze(1), tokens, probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[N, V] non-negative weights (rows need not sum to 1) -> [N] int64 token ids."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device`: seeded when `seed` is given (reproducible), else random."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
