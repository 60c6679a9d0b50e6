"""A round's further decode steps queued on the device behind its first as self-advancing steps
(specsplit/model/decode_graphs.py), where the engine otherwise runs them one by one in `finish`
(`VerifierEngine._decode_further`: a launch, a wait and a commit on the host a step, which a
busy service process can be slower at than the GPU at its step). `launch_advancing` queues
them at the round's launch, each step's input token its step before's bonus on the device;
`commit_advanced` commits their tokens once the round is finished. Greedy decode rounds only
(no tree, no hidden states, every sequence the same steps), with room for every step: anything
else runs step by step as before, with the same tokens ($SPECSPLIT_ADVANCING_DECODE=1 turns it
on; off until measured on a GPU)."""

from __future__ import annotations

import logging
import os

import torch

from specsplit.kv_cache import KVCache
from specsplit.messages import VerifyInput, VerifyOutput
from specsplit.model.batch import ForwardBatch
from specsplit.model.decode_graphs import AdvancingDecode
from specsplit.step import build_forward_batch, verify_step
from specsplit.tree import DraftTree
from verifier.round_accept import to_host
from verifier.rounds import Advanced, Launched, VerifierSeq, committed_as

ADVANCING_DECODE = os.environ.get("SPECSPLIT_ADVANCING_DECODE", "0") == "1"

log = logging.getLogger(__name__)


def launch_advancing(
    advancing: AdvancingDecode,
    kv: KVCache,
    max_context: int,
    inputs: list[VerifyInput],  # the round's, in the order of its parts' results
    parts: list[Launched],  # the round's first step, launched (a step run ahead, its own)
    bonus: list[torch.Tensor],  # each part's bonus tokens on the device, its inputs' order
) -> Advanced | None:
    """The round's further decode steps queued behind `parts`, or None where they do not
    qualify (sampled, a tree or hidden states, unequal steps, past the context, no free pages
    for every step, no captured bucket): then nothing is reserved or queued."""
    seqs = [seq for part in parts for seq in part.seqs]
    num_steps = inputs[0].decode_steps - 1
    if not 1 <= num_steps <= advancing.max_steps:
        return None
    if any(part.hinted or part.chain_hints is not None for part in parts):
        return None  # (a chained round's commit trims its room: not the steps')
    for item in inputs:
        plain = not item.tree and not item.hidden_state_layers and item.sampling.greedy
        if not plain or item.decode_steps != num_steps + 1:
            return None
    # each sequence's length once the first step is committed: its further steps' first
    # token sits there
    lengths = [
        seq.kv.kv_committed_len + len(item.pending_tokens)
        for item, seq in zip(inputs, seqs, strict=True)
    ]
    ends = [length + num_steps for length in lengths]
    if max(ends) > max_context:
        return None
    need = sum(kv.num_new_pages(seq.kv, end) for seq, end in zip(seqs, ends, strict=True))
    most_pages = max(
        max(len(seq.kv.page_table), -(-end // kv.page_size))
        for seq, end in zip(seqs, ends, strict=True)
    )
    if need > kv.allocator.num_free or not advancing.fits(len(seqs), most_pages):
        return None
    held = [seq.kv.kv_allocated_len for seq in seqs]
    for seq, end in zip(seqs, ends, strict=True):
        kv.reserve(seq.kv, end)
    try:
        started = copied = None
        if kv.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record(torch.cuda.current_stream(kv.device))
        advancing.start(_first_step(seqs, lengths, kv.page_size), torch.cat(bonus))
        for _ in range(num_steps):
            advancing.step()
        host = to_host(advancing.tokens(num_steps))
        if kv.device.type == "cuda":
            copied = torch.cuda.Event(enable_timing=True)
            copied.record(torch.cuda.current_stream(kv.device))
    except Exception:  # the round goes on step by step: its room as it was
        log.exception("a round's advancing decode steps failed to launch")
        for seq, length in zip(seqs, held, strict=True):
            kv.trim(seq.kv, length)
        return None
    return Advanced(seqs, num_steps, host, copied, started)


def _first_step(seqs: list[VerifierSeq], lengths: list[int], page_size: int) -> ForwardBatch:
    """The first further step's batch (host tensors): one token a sequence at storage and
    position `lengths` (its input id a placeholder: the device's bonus token replaces it), the
    sequences' whole page tables. Built at the lengths the first step's commit will leave."""
    with committed_as(seqs, lengths):
        steps = [verify_step(seq.kv, [0], DraftTree(), [0]) for seq in seqs]
    return build_forward_batch(steps, page_size)[0]


def commit_advanced(advanced: Advanced, outputs: list[VerifyOutput]) -> int:
    """Commit the steps' tokens into `outputs` (the round's first step's, in the order of
    `advanced.seqs`; waits for the copy): each step's input token becomes a decoded token, its
    bonus token the output's, every sequence `num_steps` further. Returns their device time,
    nanoseconds."""
    advanced.wait()
    rows = advanced.host.tolist()  # [num_steps][B]
    for b, (seq, out) in enumerate(zip(advanced.seqs, outputs, strict=True)):
        for step in rows:
            out.decoded_tokens.append(out.bonus_token)
            out.bonus_token = step[b]
        seq.kv.kv_committed_len += advanced.num_steps
        out.kv_committed_len = seq.kv.kv_committed_len
    return advanced.device_ns()
