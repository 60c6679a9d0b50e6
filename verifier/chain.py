"""A hinted round chained on the device behind the round it follows.

While round r runs on the verifier's GPU, the gateway's hint names the tree it will send next
for each outcome of r (accepted drafts + bonus -> tree). Where every sequence of r has such a
hint and its outcomes' trees share one shape, the next round need not wait for r's results on
the host: it is queued on the device right behind r, built for one outcome (the reference: r's
tree accepted to its deepest node, the room of any outcome, reserved) and placed on the outcome
that came by two kernels run between r and it (specsplit/kernels/place_chain.py; the hints'
tables cross in one copy, `chain_inputs`): each sequence's outcome is found among its hint's
from r's results, and the round's input ids, positions, KV slots and lengths
(`place_forward`) and its acceptance's draft tokens and page window (`place_accept`) are
rewritten for it. An outcome not among the hint's of a sequence whose hint runs misses plain
(`NextTrees.plain`: the gateway then sends a round with r's bonus token and no tree) is placed
as that plain round: r's bonus token first, the reference's tree after it, and no draft tokens
for the acceptance, which takes none of them (its bonus token is the plain round's; the nodes'
K/V sits past the committed length). The GPU then runs r+1 back to back with r, while the
host commits and answers r.

The host learns the outcome when r finishes (`resolve`): a sequence whose outcome was among
its hint's, or was placed plain, gets the round's inputs as the gateway will send them
(`VerifierEngine._take_ahead` keeps it only for exactly that round); any other gets none (its
share is dropped: its K/V writes sit past its committed length, where its next round writes
again).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specsplit.kernels import place_chain
from specsplit.kernels.place_chain import outcome_keys
from specsplit.messages import NO_LOGPROBS, NextTrees, VerifyInput
from specsplit.model.batch import ForwardBatch
from specsplit.model.transfer import to_device
from specsplit.tree import DraftTree
from verifier.accept_layout import padded, window_pages
from verifier.rounds import Launched


@dataclass
class Chain:
    """A chained round's placement: r's results and the hints' tables on the device, and per
    sequence, once placed (`place_forward`), its committed length after r, its input ids (bonus
    token, then the tree drafted for its outcome) and the outcome placed."""

    packed: torch.Tensor  # [>= B, 2 + N] int64: r's results (compact_and_pack's)
    bases: torch.Tensor  # [B] int64: r's committed length + its pending tokens
    keys: torch.Tensor  # [B, O] int64: each outcome's key (-1: none)
    next_tokens: torch.Tensor  # [B, O, q] int64: each outcome's bonus token, then its tree
    plain: torch.Tensor  # [B] int64: 1 where the hint runs misses plain
    table: torch.Tensor  # [B, max_pages] int64: the page tables (the reference's room)
    page_size: int
    committed: torch.Tensor  # [B] int64, written by `place_forward`
    tokens: torch.Tensor  # [B, q] int64, written by `place_forward`
    placed: torch.Tensor  # [B] int64, written by `place_forward`: the outcome, -1 a miss plain


def chainable(item: VerifyInput, hint: NextTrees | None) -> DraftTree | None:
    """The reference tree of `item`'s next round (its hint's tree for the longest outcome), or
    None when that round cannot be chained: no hint for `item`'s round, a sampled round, one of
    several decode steps, one that asks for log-probabilities or has logit rules (the
    next round's read its outcome), or outcomes whose trees differ in
    shape (all must read the same mask, positions and rows; hidden-state rows too: the pending
    token's, then the accepted path's, gathered on the device by the chained round's own
    acceptance)."""
    if (
        hint is None
        or not hint.trees
        or hint.base != item.kv_committed_len + len(item.pending_tokens)
        or not item.sampling.greedy
        or item.decode_steps != 1
        or item.logprobs != NO_LOGPROBS
        or item.rules is not None
    ):
        return None
    parents = hint.trees[0].tree.parents
    if any(t.tree.parents != parents or t.tree.draft_probs is not None for t in hint.trees):
        return None
    if any(len(t.tokens) > len(item.tree) + 1 for t in hint.trees):
        return None
    return max(hint.trees, key=lambda t: len(t.tokens)).tree


def chain_inputs(
    packed: torch.Tensor,  # r's results on the device [>= B, 2 + N] (compact_and_pack's)
    rounds: list[VerifyInput],  # r's inputs, in `packed`'s order
    hints: list[NextTrees],  # each one's hint (`chainable`)
    table: np.ndarray,  # [B, max_pages] the chained round's page tables
    page_size: int,
) -> Chain:
    """The chained round's placement: the hints' tables on the device (one host-to-device
    copy), for `place_forward`, which places each sequence on the first outcome of its hint's
    with r's number of accepted drafts and bonus token (`outcome_index`); where none has them,
    on the first outcome all the same: as the plain round where the hint runs misses plain,
    else as is (the host drops that share, `resolve`)."""
    b = len(rounds)
    num_outcomes = max(len(hint.trees) for hint in hints)
    q = 1 + len(hints[0].trees[0].tree)
    # bases [B], keys [B, O] (-1: no outcome), next tokens [B, O, q], plain [B], table [B, P]:
    # one flat host array, filled through numpy views (~1 us a write; np.zeros a part ~2)
    shapes = [(b,), (b, num_outcomes), (b, num_outcomes, q), (b,), table.shape]
    flat = np.zeros(sum(math.prod(shape) for shape in shapes), np.int64)
    bases, keys, next_tokens, plain, table_h = _pieces(flat, shapes)
    keys[:] = -1
    for i, (item, hint) in enumerate(zip(rounds, hints, strict=True)):
        outcomes = hint.trees
        bases[i] = item.kv_committed_len + len(item.pending_tokens)
        plain[i] = hint.plain
        keys[i, : len(outcomes)] = [outcome_keys(len(a.tokens) - 1, a.tokens[-1]) for a in outcomes]
        next_tokens[i, : len(outcomes)] = [[a.tokens[-1], *a.tree.tokens] for a in outcomes]
    table_h[:] = table
    device = to_device(torch.from_numpy(flat), packed.device)
    sizes = [math.prod(shape) for shape in shapes]
    bases_d, keys_d, next_d, plain_d, table_d = (
        piece.view(shape) for piece, shape in zip(device.split(sizes), shapes, strict=True)
    )
    written = torch.empty(b * (q + 2), dtype=torch.int64, device=packed.device)
    committed, placed, tokens = written[:b], written[b : 2 * b], written[2 * b :].view(b, q)
    return Chain(
        packed, bases_d, keys_d, next_d, plain_d, table_d, page_size, committed, tokens, placed
    )


def _pieces(flat: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Consecutive pieces of a flat array in these shapes, as views."""
    pieces, end = [], 0
    for shape in shapes:
        size = math.prod(shape)
        pieces.append(flat[end : end + size].reshape(shape))
        end += size
    return pieces


def outcome_index(hint: NextTrees, num_accepted: int, bonus: int) -> int | None:
    """The outcome of `hint` that `chain_inputs` places for a round that accepted
    `num_accepted` drafts and drew `bonus` (the first with that many accepted drafts and that
    bonus), or None."""
    return next(
        (
            o
            for o, ahead in enumerate(hint.trees)
            if len(ahead.tokens) == num_accepted + 1 and ahead.tokens[-1] == bonus
        ),
        None,
    )


def joined_results(parts: list[Launched], device: torch.device) -> torch.Tensor:
    """The results of a round's parts on the device, their inputs' order ([B, 2 + N], -1
    padded): a part taken for some of its sequences gives their rows."""
    width = max(part.packed.shape[1] for part in parts)
    pieces = []
    for part in parts:
        rows = part.own_results(device)
        if rows.shape[1] < width:
            rows = torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=-1)
        pieces.append(rows)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def chain_inputs_reference(
    results: list[list[int]],  # r's result rows on the host (compact_and_pack's)
    rounds: list[VerifyInput],
    hints: list[NextTrees],
) -> tuple[list[int], list[list[int]]]:
    """`chain_inputs`' committed lengths and input ids, per sequence in plain Python (tests)."""
    committed, tokens = [], []
    for row, item, hint in zip(results, rounds, hints, strict=True):
        accepted, bonus = row[0], row[1]
        index = outcome_index(hint, accepted, bonus)
        ahead = hint.trees[0 if index is None else index]
        committed.append(item.kv_committed_len + len(item.pending_tokens) + accepted)
        first = bonus if index is None and hint.plain else ahead.tokens[-1]
        tokens.append([first, *ahead.tree.tokens])
    return committed, tokens


def place_forward(batch: ForwardBatch, chain: Chain) -> None:
    """Rewrite the first B sequences of `batch` (on the device, built for the reference
    outcome: one pending token, then the tree) for the outcomes that came: input ids,
    positions (each token's offset past the committed prefix kept), K/V slots and lengths;
    `chain.committed` / `chain.tokens` set. One kernel on a GPU (specsplit/kernels/
    place_chain.py), its torch reference elsewhere."""
    place = place_chain.place_forward if _on_gpu(chain) else place_chain.place_forward_reference
    place(
        chain.packed, chain.bases, chain.keys, chain.next_tokens, chain.plain, chain.table,
        chain.page_size, batch.input_ids, batch.positions, batch.slot_mapping, batch.kv_lens,
        batch.prefix_lens, chain.committed, chain.tokens, chain.placed,
    )  # fmt: skip


def place_accept(parts: list[torch.Tensor], chain: Chain) -> None:
    """Rewrite the first B rows of an acceptance's inputs (`Layout.parts` on the device) for the
    outcomes that came (after `place_forward`): the draft tokens (none for a miss placed plain),
    and the page window from the tree's storage on."""
    _, draft, _, base, window = parts
    place = place_chain.place_accept if _on_gpu(chain) else place_chain.place_accept_reference
    place(
        chain.committed, chain.tokens, chain.placed, chain.table, chain.page_size, draft, base,
        window,
    )  # fmt: skip


def warm_up_chain(device: torch.device, query_lens: Sequence[int], page_size: int) -> None:
    """The placement kernels compiled for rounds of `query_lens` tokens a sequence (the graphs'),
    their acceptance's page windows as its graphs pad them."""
    windows = [window_pages(padded(q - 1), page_size) for q in query_lens]
    place_chain.warm_up(device, list(zip(query_lens, windows, strict=True)))


def _on_gpu(chain: Chain) -> bool:
    return chain.packed.device.type == "cuda"


def resolve(
    chained: list[VerifyInput], hints: list[NextTrees], results: list[tuple[list[int], int, int]]
) -> list[bool]:
    """Once r is committed (`results`: each sequence's accepted tokens, bonus token and
    committed length), each chained input becomes the round the gateway will send (its bonus
    token pending, the tree drafted for its outcome) where its outcome was among its hint's,
    or the plain round (no tree) where it was placed plain (not among them, and the hint runs
    misses plain); the others can never be taken (kv_committed_len -1). Returns which were."""
    found = []
    for item, hint, (accepted, bonus, committed) in zip(chained, hints, results, strict=True):
        index = outcome_index(hint, len(accepted), bonus)  # the one placed on the device
        if index is None and hint.plain:
            tree: DraftTree | None = DraftTree()  # placed plain: r's bonus token, no drafts
        elif index is not None and hint.trees[index].tokens == [*accepted, bonus]:
            tree = hint.trees[index].tree
        else:  # (another path of the same length and bonus than the one placed: not it)
            tree = None
        found.append(tree is not None)
        item.kv_committed_len = committed if tree is not None else -1
        item.pending_tokens = [bonus]
        item.tree = item.tree if tree is None else tree
    return found
