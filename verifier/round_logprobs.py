"""The log-probabilities of a round's new tokens (VerifyInput.logprobs) under the target, queued
on the verifier's device after the round's acceptance (`queue_logprobs`) and read with its
results (`read_logprobs`). Each new token's is its logit at its parent's row (the row that
predicted it: the root's for the first, then each accepted node's) less that row's logsumexp:
the raw distribution, before temperature and top-k / top-p, as vLLM and OpenAI report it. Only
sequences that ask pay for it: a round where none does queues nothing.

Every tree node's log-probability is taken (its row and token are known before acceptance),
the bonus token's at the row of the last accepted node (read from the acceptance's results on
the device), and every row's top tokens, by specsplit/kernels/logprobs.py's two launches on a
GPU (their references on the CPU); the host picks the accepted path's. One device-to-host copy
of a float32 tensor, queued before the round's results' copy, whose wait covers it."""

from __future__ import annotations

import torch

from specsplit.kernels.logprobs import token_logprobs, top_logprobs
from specsplit.messages import TokenLogprobs, VerifyInput
from specsplit.model.transfer import to_device
from verifier.round_accept import to_host
from verifier.rounds import LogprobSlot, PromptRows, RoundLogprobs


def queue_logprobs(
    inputs: list[VerifyInput],
    logits: torch.Tensor,  # [L, vocab] on the device: the round's forward's
    rows: list[range],  # per sequence its n + 1 rows of `logits`: the root, then each node
    packed: torch.Tensor,  # the acceptance's results on the device ([>= B, 2 + N])
) -> RoundLogprobs | None:
    """The log-probabilities the round's sequences ask for, queued on `logits`' device
    (specsplit/kernels/logprobs.py: one launch for the tokens, one for the rows' top tokens);
    None when none asks."""
    asked = [b for b, item in enumerate(inputs) if item.logprobs >= 0]
    if not asked:
        return None
    width = max(inputs[b].logprobs for b in asked)
    # one host array, one copy in: a query (row, token, -1) per tree node at its parent's row,
    # a query (root row, 0, b) per asking sequence's bonus token, then (row, 0, 0) per row
    nodes: list[tuple[int, int, int]] = []
    top_rows: list[tuple[int, int, int]] = []
    slots = []
    for k, b in enumerate(asked):
        item, r = inputs[b], rows[b]
        slots.append(LogprobSlot(b, k, len(nodes), len(top_rows), item.logprobs))
        tree = item.tree
        nodes += [(r[p + 1], t, -1) for p, t in zip(tree.parents, tree.tokens, strict=True)]
        top_rows += [(row, 0, 0) for row in r]
    bonuses = [(rows[b].start, 0, b) for b in asked]
    queries = len(nodes) + len(bonuses)
    meta = to_device(torch.tensor([*nodes, *bonuses, *top_rows]), logits.device)
    values = torch.empty(queries + len(top_rows) * 2 * width, device=logits.device)
    token_logprobs(logits, meta[:queries], packed, out=values[:queries])
    top = values[queries:].view(len(top_rows), 2 * width)
    top_logprobs(logits, meta[queries:], width, out=top)
    return RoundLogprobs(to_host(values), slots, len(nodes), queries, width)


def read_logprobs(
    launched: RoundLogprobs,
    num_inputs: int,
    results: list[list[int]],  # per input its results row: [a, bonus, the a accepted nodes...]
) -> list[TokenLogprobs | None]:
    """Per input, its new tokens' log-probabilities (its accepted drafts', then its bonus
    token's), None where it asked for none; `launched`'s values valid (the round's results read)."""
    values = launched.values.tolist()
    width = launched.width
    bonus_at, top_at = launched.num_nodes, launched.num_queries
    out: list[TokenLogprobs | None] = [None] * num_inputs
    for slot in launched.slots:
        row = results[slot.position]
        nodes = row[2 : 2 + row[0]]
        chosen = [values[slot.first_node + node] for node in nodes]
        chosen.append(values[bonus_at + slot.index])
        # each new token's row among the sequence's (the root's, then each accepted node's):
        # its k largest values, then their columns
        starts = [
            top_at + (slot.first_row + r) * 2 * width for r in [0, *(node + 1 for node in nodes)]
        ]
        asks = slot.asks
        top_lps = [values[s : s + asks] for s in starts]
        top_ids = [[int(t) for t in values[s + width : s + width + asks]] for s in starts]
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


def queue_prompt(logits: torch.Tensor, rows: range, tokens: list[int], width: int) -> PromptRows:
    """A first round's prompt log-probabilities (VerifyInput.prompt_logprobs) queued on the
    device: each of `tokens` but the first at the row before it (`rows`: the pending tokens'
    rows but the last's), under the raw distribution, and the `width` most likely tokens'
    there. Eager torch ops: a prompt's scoring (an evaluation's), not a served round's cost."""
    lp = torch.log_softmax(logits[rows.start : rows.stop].float(), dim=-1)
    ids = to_device(torch.tensor(tokens[1:], dtype=torch.int64), logits.device)
    chosen = lp.gather(1, ids[:, None])[:, 0]
    if not width:
        return PromptRows(chosen, None)
    top = lp.topk(width, dim=-1)
    return PromptRows(chosen, (top.values, top.indices))


def read_prompt(rows: PromptRows) -> TokenLogprobs:
    """`queue_prompt`'s values on the host (waits for the device)."""
    chosen = rows.chosen.tolist()
    if rows.top is None:
        return TokenLogprobs(chosen, [[] for _ in chosen], [[] for _ in chosen])
    values, ids = rows.top
    return TokenLogprobs(chosen, ids.tolist(), values.tolist())
