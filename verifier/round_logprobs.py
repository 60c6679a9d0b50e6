"""The log-probabilities of a round's new tokens (VerifyInput.logprobs) under the target, queued
on the verifier's device after the round's acceptance (`queue_logprobs`) and read with its
results (`read_logprobs`). Each new token's is its logit at its parent's row (the row that
predicted it: the root's for the first, then each accepted node's) less that row's logsumexp:
the raw distribution, before temperature and top-k / top-p, as vLLM and OpenAI report it. Only
sequences that ask pay for it: a round where none does queues nothing.

Every tree node's log-probability is gathered (its row and token are known before acceptance),
the bonus token's at the row of the last accepted node (read from the acceptance's results on
the device), and every row's top tokens; the host picks the accepted path's. One device-to-host
copy of a float64 tensor, queued before the round's results' copy, whose wait covers it."""

from __future__ import annotations

import torch

from specsplit.messages import TokenLogprobs, VerifyInput
from specsplit.model.transfer import to_device
from verifier.round_accept import to_host
from verifier.rounds import LogprobSlot, RoundLogprobs


def queue_logprobs(
    inputs: list[VerifyInput],
    logits: torch.Tensor,  # [L, vocab] on the device: the round's forward's
    rows: list[range],  # per sequence its n + 1 rows of `logits`: the root, then each node
    packed: torch.Tensor,  # the acceptance's results on the device ([>= B, 2 + N])
) -> RoundLogprobs | None:
    """The log-probabilities the round's sequences ask for, queued on `logits`' device; None
    when none asks."""
    asked = [b for b, item in enumerate(inputs) if item.logprobs >= 0]
    if not asked:
        return None
    width = max(inputs[b].logprobs for b in asked)
    # host indices, one copy in: every asking row; each node's parent row and token; each
    # sequence's root row and its position in the round
    asked_rows: list[int] = []
    parent_rows: list[int] = []
    node_tokens: list[int] = []
    slots = []
    for k, b in enumerate(asked):
        item, r = inputs[b], rows[b]
        slots.append(LogprobSlot(b, k, len(node_tokens), len(asked_rows), item.logprobs))
        asked_rows += r
        parent_rows += [r[p + 1] for p in item.tree.parents]  # (parent -1: the root's row)
        node_tokens += item.tree.tokens
    roots = [rows[b].start for b in asked]
    index = to_device(
        torch.tensor([*asked_rows, *parent_rows, *node_tokens, *roots, *asked]), logits.device
    )
    asked_d, parents_d, tokens_d, roots_d, positions_d = index.split(
        [len(asked_rows), len(parent_rows), len(node_tokens), len(roots), len(asked)]
    )
    lse = torch.logsumexp(logits.float(), dim=-1)  # [L]
    nodes = logits[parents_d, tokens_d].double() - lse[parents_d].double()
    # the bonus token's row: the last accepted node's (each result [a, bonus, nodes...])
    results = packed.index_select(0, positions_d).long()
    num_accepted, bonus = results[:, 0], results[:, 1]
    last = results.gather(1, (num_accepted + 1).clamp(max=results.shape[1] - 1)[:, None])[:, 0]
    bonus_rows = roots_d + torch.where(num_accepted > 0, last + 1, 0)
    bonus_lp = logits[bonus_rows, bonus].double() - lse[bonus_rows].double()
    parts = [nodes, bonus_lp]
    if width:
        top, top_ids = logits.index_select(0, asked_d).float().topk(width, dim=-1)
        parts += [(top - lse[asked_d, None]).double().reshape(-1), top_ids.double().reshape(-1)]
    values = to_host(torch.cat(parts))
    return RoundLogprobs(values, slots, len(node_tokens), len(asked_rows), width)


def read_logprobs(
    launched: RoundLogprobs,
    num_inputs: int,
    results: list[list[int]],  # per input its results row: [a, bonus, the a accepted nodes...]
) -> list[TokenLogprobs | None]:
    """Per input, its new tokens' log-probabilities (its accepted drafts', then its bonus
    token's), None where it asked for none; `launched`'s values valid (the round's results read)."""
    values = launched.values.tolist()
    width = launched.width
    bonus_at = launched.num_nodes
    top_at = bonus_at + (launched.num_rows - launched.num_nodes)  # (a bonus per asking root)
    ids_at = top_at + launched.num_rows * width
    out: list[TokenLogprobs | None] = [None] * num_inputs
    for slot in launched.slots:
        row = results[slot.position]
        nodes = row[2 : 2 + row[0]]
        chosen = [values[slot.first_node + node] for node in nodes]
        chosen.append(values[bonus_at + slot.index])
        # each new token's row among the sequence's: the root's, then each accepted node's
        starts = [(slot.first_row + r) * width for r in [0, *(node + 1 for node in nodes)]]
        asks = slot.asks
        top_ids = [[int(t) for t in values[ids_at + s : ids_at + s + asks]] for s in starts]
        top_lps = [values[top_at + s : top_at + s + asks] for s in starts]
        out[slot.position] = TokenLogprobs(chosen, top_ids, top_lps)
    return out


def logprobs_reference(
    logits: torch.Tensor,  # [L, vocab]
    rows: list[int],  # each new token's parent row
    tokens: list[int],  # each new token
    width: int,
) -> TokenLogprobs:
    """The log-probabilities of `tokens`, each at its row of `logits`, computed one row at a
    time with log_softmax (the tests' reference for `queue_logprobs`)."""
    out = TokenLogprobs()
    for row, token in zip(rows, tokens, strict=True):
        logp = torch.log_softmax(logits[row].double(), dim=-1)
        out.logprobs.append(float(logp[token]))
        top, ids = logp.topk(width) if width else (logp[:0], logp[:0].long())
        out.top_ids.append([int(t) for t in ids])
        out.top_logprobs.append([float(v) for v in top])
    return out
