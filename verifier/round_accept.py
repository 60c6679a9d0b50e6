"""A verify round's acceptance on the verifier's device, apart from the engine that schedules it:
`queue_accept` lays the batch out in one host array (verifier/accept_layout.py's Layout, and a
sampled round's Sampling with each sequence's uniforms drawn from its own generator), then runs
the acceptance as a CUDA graph's replay where one fits, else eagerly; the hidden-state rows the
drafter gets (`accepted_hidden`, `hidden_states_out`); synthetic acceptance's bent logits for
benchmarks (`bend_logits`); results to the host (`to_host`)."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import numpy as np
import torch

from specsplit.kernels.accepted_rows import accepted_rows, accepted_rows_reference
from specsplit.kernels.argmax import greedy_tokens
from specsplit.kv_cache import KVCache
from specsplit.messages import VerifyInput, VerifyOutput
from specsplit.model.transfer import to_device
from specsplit.sampling import SamplingParams, make_generator
from verifier.accept_graphs import AcceptGraphs, greedy_accept, sampled_accept
from verifier.accept_layout import Sampling, eager_layout, eager_sampling, page_window, window_pages
from verifier.rounds import VerifierSeq

SYNTHETIC_BIG = 1e30  # synthetic acceptance's bent logits: +-this (fits bfloat16's range)


def to_host(rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """rows (in `dtype`, None = theirs) on the host; from a GPU an asynchronous copy into
    pinned memory (valid once the stream has been waited for)."""
    rows = rows if dtype is None else rows.to(dtype)
    if rows.device.type != "cuda":
        return rows
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    return host.copy_(rows, non_blocking=True)


def _filters(params: SamplingParams, vocab_size: int) -> bool:
    """Whether sampling with `params` cuts the distribution (top-k or top-p): its round's
    acceptance finds each row's cut threshold."""
    return not params.greedy and (params.top_p < 1.0 or 0 < params.top_k < vocab_size)


def accepted_hidden(
    inputs: list[VerifyInput],
    hidden_states: torch.Tensor,  # [rows of the step, layers * hidden] on the device
    packed: torch.Tensor,  # the acceptance's results on the device (`queue_accept`)
    device: torch.device,
) -> torch.Tensor:
    """The hidden-state rows the drafter gets, on the host in bfloat16: per sequence that
    asked, its pending tokens' rows, then its accepted path's, back to back from row 0
    (`specsplit.kernels.accepted_rows`; from a GPU gathered there and copied
    asynchronously, valid once the round's results are)."""
    # per sequence: pending tokens, tree nodes, whether it asked (its rows follow the last's)
    shape = tuple((len(i.pending_tokens), len(i.tree), bool(i.hidden_state_layers)) for i in inputs)
    if hidden_states.device.type != "cuda":
        starts, pending, asks = _rows_meta(shape)
        return accepted_rows_reference(hidden_states, packed, starts, pending, asks, torch.bfloat16)
    meta = _device_meta(shape, device)
    return to_host(accepted_rows(hidden_states, packed, meta, torch.bfloat16))


def _rows_meta(shape: tuple[tuple[int, int, bool], ...]) -> tuple[list[int], list[int], list[bool]]:
    """`accepted_rows`' starts, pending and asks of a batch of this shape (`accepted_hidden`)."""
    starts, row = [], 0
    for p, n, _ in shape:
        starts.append(row)
        row += p + n
    return starts, [p for p, _, _ in shape], [ask for _, _, ask in shape]


@functools.lru_cache(maxsize=1024)
def _device_meta(shape: tuple[tuple[int, int, bool], ...], device: torch.device) -> torch.Tensor:
    """`_rows_meta` of `shape` as `accepted_rows`' [3, B] int64 on `device`, made once per shape
    (rounds repeat a few: one pending token and the round's tree), never written: a round reads
    it while the next may take it again (~40 us of host work a round otherwise)."""
    return to_device(torch.tensor(_rows_meta(shape), dtype=torch.int64), device)


def hidden_states_out(
    inputs: list[VerifyInput],
    hidden: torch.Tensor,  # `accepted_hidden`'s rows
    results: list[VerifyOutput],  # committed: their accepted drafts say each path's length
    starts: list[int] | None = None,  # each input's first row (None: back to back)
) -> None:
    """Each sequence that asked for hidden states gets [p + num_accepted_drafts, layers *
    hidden]: its pending tokens, then the accepted path (views of `hidden`, back to back)."""
    row = 0
    for i, (item, output) in enumerate(zip(inputs, results, strict=True)):
        if item.hidden_state_layers:
            row = row if starts is None else starts[i]
            end = row + len(item.pending_tokens) + output.num_accepted_drafts
            output.hidden_states = hidden[row:end]
            row = end


def decode_accept(argmax: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """`queue_accept` of a greedy round without trees whose sequence b has logits row b (decode
    steps, first rounds): nothing to accept or move, each bonus token its row's argmax
    (`argmax`, [L]). [B, 2] as compact_and_pack's, in two ops: the acceptance's way (a host
    array, its copy in, a graph replay) cost ~0.18 ms of a GPU host's time a decode step
    (bench/RESULTS.md), about a third of what the host spends launching one."""
    bonus = argmax[:num_seqs]
    return torch.stack((torch.zeros_like(bonus), bonus), dim=1)


def queue_accept(
    inputs: list[VerifyInput],
    seqs: list[VerifierSeq],
    logits: torch.Tensor,  # [L, vocab] on the device
    rows: list[range],  # per sequence its n + 1 rows of `logits`
    block_table: torch.Tensor,  # [B, max_pages] the step's pages (host)
    kv: KVCache,
    vocab_size: int,
    graphs: AcceptGraphs | None,  # greedy and sampled acceptance's CUDA graphs, if captured
    place: Callable[[list[torch.Tensor]], None] | None = None,  # a chained round's (chain.py)
    argmax: torch.Tensor | None = None,  # [L] int64 each logits row's argmax, if taken
) -> torch.Tensor:
    """Acceptance (greedy, or lossless sampling when any sequence samples), the bonus token
    and the accepted path's K/V compaction for the whole batch, queued on the device:
    per sequence [accepted drafts, bonus, nodes...] ([B, 2 + N], -1 padded;
    `VerifierEngine._finish` copies it to the host). argmax: the logits' argmax where the
    forward's graph took it (ForwardOutput.greedy); a greedy round's is taken here otherwise,
    the one place a round takes it (`greedy_tokens`: the GPU's many-program argmax)."""
    greedy = all(i.sampling.greedy for i in inputs)
    if not greedy:
        argmax = None  # acceptance reads the logits
    elif argmax is None:
        argmax = greedy_tokens(logits)
    plain = place is None and all(
        not i.tree and r.start == b for b, (i, r) in enumerate(zip(inputs, rows, strict=True))
    )
    if argmax is not None and plain:
        return decode_accept(argmax, block_table.shape[0])
    args = (inputs, seqs, logits, rows, block_table, kv, vocab_size, graphs, place, argmax)
    return queue_full_accept(*args)


def queue_full_accept(
    inputs: list[VerifyInput],
    seqs: list[VerifierSeq],
    logits: torch.Tensor,
    rows: list[range],
    block_table: torch.Tensor,
    kv: KVCache,
    vocab_size: int,
    graphs: AcceptGraphs | None,
    place: Callable[[list[torch.Tensor]], None] | None = None,
    argmax: torch.Tensor | None = None,  # [L] int64 each logits row's argmax: a greedy round's
) -> torch.Tensor:
    """`queue_accept`'s way for any round: its inputs in one host array copied in, then the
    acceptance graph of its layout replayed, or (the CPU; past the graphs) its body run. A
    greedy round (every sequence greedy) comes with the logits' `argmax`, a sampled one
    without."""
    width = max(len(item.tree) for item in inputs)  # N
    num_seqs = block_table.shape[0]
    greedy = all(i.sampling.greedy for i in inputs)
    assert greedy == (argmax is not None), "a greedy round's argmax, and only a greedy round's"
    layout = None if graphs is None else graphs.layout(num_seqs, width)
    sampling: Sampling | None = None
    support, filters = 0, False
    if not greedy:
        supports = [i.tree.draft_probs for i in inputs if i.tree.draft_probs is not None]
        support = max((probs.width for probs in supports), default=0)
        filters = any(_filters(i.sampling, vocab_size) for i in inputs)
        if graphs is not None and layout is not None:
            sampling = graphs.sampling(layout, support, filters)
            layout = None if sampling is None else layout
    # one host array, one copy to the device (Layout.shapes: each sequence's rows of
    # `logits`, draft tokens, parents, storage of tree node 0, its page-table window; a
    # sampled round's params, uniforms and draft distributions in a float64 one beside it);
    # numpy views for the per-sequence writes (~1 us each, torch's ~5-10)
    floats: np.ndarray | None = None
    if graphs is not None and layout is not None:  # a CUDA graph's padded layout
        host, parts, float_parts = graphs.host_arrays(layout, sampling)
    else:
        graphs, layout = None, eager_layout(num_seqs, width, window_pages(width, kv.page_size))
        host, parts = layout.host_arrays()
        if not greedy:
            sampling = eager_sampling(num_seqs, width, support if width else 0, filters)
            floats, float_parts = sampling.host_arrays()
    row_index_h, draft_h, parents_h, base_h, table_h = parts
    base = np.array(
        [item.kv_committed_len + len(item.pending_tokens) for item in inputs], dtype=np.int64
    )
    if width == 0:  # decode steps: each sequence's one row, no drafts (one numpy write)
        row_index_h[:num_seqs, 0] = [r.start for r in rows]
    else:
        for b, (item, r) in enumerate(zip(inputs, rows, strict=True)):
            n = len(item.tree)
            row_index_h[b, : n + 1] = r
            draft_h[b, :n] = item.tree.tokens
            parents_h[b, :n] = item.tree.parents
    table_h[:num_seqs], base_h[:num_seqs] = page_window(
        block_table.numpy(), base, layout.pages, kv.page_size
    )
    if sampling is not None:
        _sampling_inputs(inputs, seqs, float_parts, layout.width)
    if graphs is not None:
        return graphs.run(layout, logits, num_seqs, sampling, place, argmax)
    # the CPU; rounds past the acceptance graphs: the graphs' bodies, run eagerly
    device_inputs = to_device(torch.from_numpy(host), kv.device)
    if place is not None:
        place(layout.parts(device_inputs))
    if sampling is not None:
        assert floats is not None
        device_floats = to_device(torch.from_numpy(floats), kv.device)
        return sampled_accept(layout, sampling, device_inputs, device_floats, logits, kv)
    assert argmax is not None
    return greedy_accept(layout, device_inputs, argmax, kv)


def _sampling_inputs(
    inputs: list[VerifyInput],
    seqs: list[VerifierSeq],
    parts: list[np.ndarray],  # Sampling.host_arrays' parts
    width: int,  # the layout's tree width (the bonus's uniform goes in this column)
) -> None:
    """A sampled round's float inputs: each sequence's params, its N + 1 uniforms drawn
    from its own generator (on the host: the same draws on any device, and whatever batch
    it is in), and its draft distribution's support. Greedy sequences draw nothing (they
    walk a one-hot target)."""
    temperature, top_p, top_k, has_q, uniforms, q_tokens, q_probs = parts
    for b, (item, seq) in enumerate(zip(inputs, seqs, strict=True)):
        params = item.sampling
        if params.greedy:
            continue
        temperature[b], top_p[b], top_k[b] = params.temperature, params.top_p, params.top_k
        if seq.generator is None:
            seq.generator = make_generator(params.seed)
        n = len(item.tree)
        draws = torch.rand(n + 1, generator=seq.generator, dtype=torch.float64).numpy()
        uniforms[b, :n] = draws[:n]
        uniforms[b, width] = draws[n]
        probs = item.tree.draft_probs
        if probs is not None:
            probs.fill(q_tokens[b, :n], q_probs[b, :n])
            has_q[b] = 1


def bend_logits(
    inputs: list[VerifyInput],
    logits: torch.Tensor,  # [L, vocab] on the device, bent in place
    rows: list[range],  # per sequence its n + 1 rows of `logits`
    rates: tuple[float, ...],
    rng: random.Random,
    device: torch.device,
    tokens: torch.Tensor | None = None,  # [B, 1 + n] on the device: the input ids (chain.py)
) -> None:
    """Benchmarks only (VerifierEngine's synthetic_acceptance): along each tree's first
    children, each accepted at its depth's rate (drawn from `rng`), the child's logit at its
    parent's row set to +BIG; where acceptance stops, every child's to -BIG. Greedy
    acceptance and lossless sampling then both accept exactly that path. One host-to-device
    copy. tokens: the trees' tokens are these (a chained round's, placed on the device), not
    the inputs'."""
    entries: list[tuple[int, int, int]] = []  # (row, token or its index in tokens, +1 / -1)
    width = 0 if tokens is None else tokens.shape[1]
    for b, (item, r) in enumerate(zip(inputs, rows, strict=True)):
        # each node's token, or its index in `tokens` (after the round's pending token)
        ids = item.tree.tokens if tokens is None else range(b * width + 1, (b + 1) * width)
        node, depth = -1, 0
        while kids := item.tree.children(node):
            row = r[node + 1]  # the row that predicts node's children
            if rng.random() >= rates[min(depth, len(rates) - 1)]:
                entries += [(row, ids[k], -1) for k in kids]
                break
            entries.append((row, ids[kids[0]], 1))
            node, depth = kids[0], depth + 1
    if entries:
        row, token_ids, sign = to_device(torch.tensor(entries).T, device)
        if tokens is not None:
            token_ids = tokens.reshape(-1)[token_ids]
        logits[row, token_ids] = sign.to(logits.dtype) * SYNTHETIC_BIG
