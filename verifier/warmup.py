"""The verifier engine's warm-up (`VerifierEngine.warmup`): a throwaway sequence's prefill and
tree round, then on a GPU the CUDA graphs of the round shapes traffic runs, the acceptance
graphs, the chained rounds' placement kernels and a rehearsal of rounds as traffic runs them,
and rounds under the logit rules clients send (their kernels built, their rules graphs at one
sequence captured), so that no request pays a capture or a compile; then a round timed eagerly
and replayed (what a round in graph parts is weighed against)."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Protocol

import numpy as np
import torch

from specsplit.kernels.triton_jit import building, building_ahead
from specsplit.kv_cache import KVCache
from specsplit.logit_rules import Allowed, Penalties, pack_mask, round_rules, start_context
from specsplit.messages import VerifyInput, VerifyOutput
from specsplit.model.attention import warm_up_attention
from specsplit.model.config import default_aux_layers
from specsplit.model.cuda_graphs import CudaGraphRunner
from specsplit.model.llama import LlamaModel
from specsplit.sampling import SamplingParams
from specsplit.tree import DraftTree
from verifier.accept_graphs import AcceptGraphs
from verifier.chain import warm_up_chain

log = logging.getLogger(__name__)

# query tokens per sequence of the steps captured as CUDA graphs: decode, and verify rounds of
# 3, 4, 8 and 16 draft tokens (chain 3 is the gateway's default)
GRAPH_QUERY_LENS = (1, 4, 5, 9, 17)
# and prefills (a prompt + its first tree, a session's next turn, a resumed sequence's tokens
# since its last features) of up to 128 tokens, at most PREFILL_MAX_BATCH at once: the eager
# forward is host-bound (SmolLM2 on an H100: 27-48 ms a step for ~1 ms of GPU time)
PREFILL_QUERY_LENS = (32, 64, 128)
PREFILL_MAX_BATCH = 4
# the logit rules rehearsed (`rehearse_rules`): the bending kernel is built per kind of rules a
# round reads, the union of its sequences' (a penalised request's first round on a cold verifier
# built three kernels in 1.0 s, bench/RESULTS.md): every union of a bias, presence / frequency,
# repetition and min_tokens' stop tokens (min_tokens held through every rehearsed round), and
# min_p alone (its cut runs in any sampled round; alone, the bending reads nothing else)
REHEARSED_RULES = tuple(
    Penalties(
        bias=((7, 2.0),) if bias else (),
        presence=0.5 if counted else 0.0,
        frequency=0.5 if counted else 0.0,
        repetition=1.1 if repeats else 1.0,
        min_tokens=16 if stops else 0,
        stop_ids=(2,) if stops else (),
        min_p=0.0 if any((bias, counted, repeats, stops)) else 0.05,
    )
    for bias, counted, repeats, stops in itertools.product((False, True), repeat=4)
)


def graphs_reserve_bytes(
    vocab_size: int, graph_query_lens: tuple[int, ...], max_batch_size: int
) -> int:
    """The device memory the warm-up's graphs take beyond the weights, kept out of the KV pool
    (`VerifierEngine.for_model`): each step graph's float32 logits of every row, without and
    with hidden states, the prefill graphs' alike, and the sampled acceptance graphs' logits
    input and [rows, vocab] intermediates (probabilities, a top-k / top-p cut's sort below 128
    rows: values, int64 order), 7 logits' worth as measured with the largest layouts captured
    first (SmolLM2 at batch 64: 1,234 MiB reserved for 204 MiB of logits, bench/graph_memory.py;
    3,356 smallest first; the whole warm-up kept 2,985 MiB beyond weights and KV, this 3,804).
    0 without graphs."""
    if not graph_query_lens:
        return 0
    logits = max_batch_size * max(graph_query_lens) * vocab_size * 4
    prefill_rows = PREFILL_MAX_BATCH * sum(PREFILL_QUERY_LENS)
    return 2 * logits * len(graph_query_lens) + 2 * prefill_rows * vocab_size * 4 + 7 * logits


class Engine(Protocol):
    """What of `VerifierEngine` the warm-up uses."""

    model: LlamaModel
    kv: KVCache
    vocab_size: int  # (what the rounds' rules are checked against)
    device: torch.device
    graphs: CudaGraphRunner | None
    accept_graphs: AcceptGraphs | None
    graph_query_lens: tuple[int, ...]
    prefill_query_lens: tuple[int, ...]

    def verify(self, inputs: list[VerifyInput]) -> list[VerifyOutput]: ...

    def release(self, seq_ids: list[str]) -> int: ...

    def check_integrity(self) -> None: ...


def warm_up(engine: Engine) -> None:
    """The warm-up's rounds and captures, on the engine's device (its counts and reports
    are `VerifierEngine.warmup`'s)."""
    out = engine.verify([VerifyInput("__warmup__", True, 0, [0, 1, 2], DraftTree([3, 4], [-1, 0]))])
    engine.verify(
        [
            VerifyInput(
                "__warmup__",
                False,
                out[0].kv_committed_len,
                [out[0].bonus_token],
                DraftTree([5, 6], [-1, -1]),
            )
        ]
    )
    engine.release(["__warmup__"])
    engine.check_integrity()
    with building_ahead():  # (active: the variants the captures take, built side by side)
        warm_up_attention(engine.kv, engine.model.config.num_heads)
        if building() and engine.graphs is not None:
            for q, aux, max_batch in graph_keys(engine, engine.graphs):
                engine.graphs.build(q, aux, max_batch)
    if engine.graphs is not None:
        for q, aux, max_batch in graph_keys(engine, engine.graphs):
            engine.graphs.capture(q, aux, max_batch)
    if engine.accept_graphs is not None:  # trees up to the largest graph's query length
        engine.accept_graphs.capture_all(max(engine.graph_query_lens) - 1)
    if engine.kv.device.type == "cuda":  # the CPU compiles nothing: no time spent there
        warm_up_chain(engine.device, engine.graph_query_lens, engine.kv.page_size)
        rehearse(engine)
        started = time.perf_counter()
        rounds = rehearse_rules(engine)
        log.info(
            "rehearsed %d rounds under logit rules: %.1f s", rounds, time.perf_counter() - started
        )
        if engine.graphs is not None:
            time_rounds(engine, engine.graphs)


def graph_keys(
    engine: Engine, graphs: CudaGraphRunner
) -> list[tuple[int, tuple[int, ...], int | None]]:
    """The (q, hidden-state layers, largest batch) of the step graphs the warm-up captures, in
    order: every graph query length, largest first (the smaller reuse its memory: as layouts);
    the prefills with and without an EAGLE-3 head's hidden states (of every prompt token), at
    most PREFILL_MAX_BATCH at once."""
    keys: list[tuple[int, tuple[int, ...], int | None]] = [
        (q, (), None) for q in sorted(engine.graph_query_lens, reverse=True)
    ]
    layers = default_aux_layers(engine.model.config.num_layers)
    max_batch = min(PREFILL_MAX_BATCH, graphs.batch_sizes[-1])
    keys += [(q, aux, max_batch) for q in engine.prefill_query_lens for aux in ((), layers)]
    return keys


def _round(
    engine: Engine,
    tokens: dict[str, list[int]],
    committed: dict[str, int],
    batch: list[tuple[str, DraftTree, tuple[int, ...]]],
) -> None:
    """One round of throwaway sequences as the gateway sends it (each (id, tree, hidden-state
    layers)): its tokens since its committed length (all of them at first: a prefill), its
    accepted tokens and bonus token then kept in `tokens`, its new length in `committed`."""
    inputs = [
        VerifyInput(
            seq_id,
            committed[seq_id] == 0,
            committed[seq_id],
            tokens[seq_id][committed[seq_id] :],
            draft,
            hidden_state_layers=aux,
        )
        for seq_id, draft, aux in batch
    ]
    for out in engine.verify(inputs):
        tokens[out.seq_id][out.kv_committed_len :] = [*out.accepted_tokens, out.bonus_token]
        committed[out.seq_id] = out.kv_committed_len


def rehearse(engine: Engine) -> None:
    """A few rounds as traffic runs them (after the graphs are captured, in inference mode):
    a prefill with a tree, a second sequence joining, rounds with and without hidden states
    (the graphs for the default EAGLE-3 layers are captured here, not on the first request),
    trees, plain decode, one sequence and two. On a GPU this builds what the capture does not:
    the eager steps' compiled kernels for inference tensors, 1 row and many (torch.compile
    specialises both). Leaves no sequence behind."""
    # an EAGLE-3 head's layers, as most heads read (a head reading others has its graphs
    # with hidden states captured on its first round)
    layers = default_aux_layers(engine.model.config.num_layers)
    chain, tree = DraftTree([7, 8, 9], [-1, 0, 1]), DraftTree([7, 8, 9, 10], [-1, -1, 0, 1])
    tokens = {"__warmup_a__": list(range(3, 23)), "__warmup_b__": list(range(5, 12))}
    committed = dict.fromkeys(tokens, 0)
    rounds: list[list[tuple[str, DraftTree, tuple[int, ...]]]] = [
        [("__warmup_a__", chain, layers)],
        [("__warmup_a__", chain, layers), ("__warmup_b__", tree, layers)],
        [("__warmup_a__", DraftTree(), layers), ("__warmup_b__", DraftTree(), ())],
        [("__warmup_b__", tree, ())],
        [("__warmup_a__", chain, layers)],
        [("__warmup_a__", DraftTree(), ())],
    ]
    for batch in rounds:
        _round(engine, tokens, committed, batch)
    # a round of several decode steps (its further steps as traffic runs them)
    steps = [
        VerifyInput(seq_id, False, committed[seq_id], ids[committed[seq_id] :], DraftTree())
        for seq_id, ids in tokens.items()
    ]
    for item in steps:
        item.decode_steps = 3
    engine.verify(steps)
    engine.release(list(tokens))
    engine.check_integrity()


def rehearse_rules(engine: Engine) -> int:
    """Rounds under each of REHEARSED_RULES, greedy and sampled, without and with a guide's
    masks (one allowing every token: the masks are a kind of rules too), one throwaway sequence
    at a time (a round's rules read the union of its sequences' kinds) as the gateway sends
    them: the first round with the whole context, the later ones with the context the verifier
    kept; a chain, a tree, several decode steps (run ahead under rules; a guide's rounds take
    one step each), a plain round. Leaves no sequence behind; returns the rounds run."""
    chain, tree = DraftTree([7, 8, 9], [-1, 0, 1]), DraftTree([7, 8, 9, 10], [-1, -1, 0, 1])
    shapes = ((chain, 1), (tree, 1), (DraftTree(), 3), (DraftTree(), 1))
    samplings = (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.95, seed=0))
    every = pack_mask(np.ones(engine.vocab_size, dtype=bool)).tobytes()
    rounds = 0
    for n, penalties in enumerate(REHEARSED_RULES):
        for sampling, guided in itertools.product(samplings, (False, True)):
            seq_id = f"__warmup_rules_{n}__"
            tokens = list(range(3, 15))
            context, committed = start_context(penalties, tokens), 0
            assert context is not None
            for draft, steps in shapes:
                allowed = Allowed(every, (0,) * (len(draft) + 1)) if guided else None
                item = VerifyInput(
                    seq_id,
                    committed == 0,
                    committed,
                    tokens[committed:],
                    draft,
                    sampling=sampling,
                    rules=round_rules(context, allowed, kept=committed > 0),
                )
                item.decode_steps = 1 if guided else steps
                out = engine.verify([item])[0]
                tokens += out.new_tokens
                committed = out.kv_committed_len
                context = context.after(out.new_tokens)
                rounds += 1
            engine.release([seq_id])
    engine.check_integrity()
    return rounds


def time_rounds(engine: Engine, graphs: CudaGraphRunner, times: int = 3) -> None:
    """Two throwaway sequences' rounds of a chain of 3 timed (the fastest of `times`): run
    eagerly (the graphs set aside) and as a graph's replay, for `CudaGraphRunner.parts_pay`:
    an eager round's wall time, and a graph round's host time beyond its replay."""
    if graphs.graph_ms([4, 4]) == 0.0:  # no graph holds the round: nothing to weigh parts by
        return
    chain = DraftTree([7, 8, 9], [-1, 0, 1])
    tokens = {"__warmup_c__": list(range(3, 13)), "__warmup_d__": list(range(5, 11))}
    committed = dict.fromkeys(tokens, 0)

    def round_ms() -> float:
        torch.cuda.synchronize(engine.device)
        started = time.perf_counter()
        _round(engine, tokens, committed, [(seq_id, chain, ()) for seq_id in tokens])
        return (time.perf_counter() - started) * 1e3

    round_ms()  # the prefills
    engine.graphs = None
    try:
        eager = min(round_ms() for _ in range(times))
    finally:
        engine.graphs = graphs
    replayed = min(round_ms() for _ in range(times))
    engine.release(list(tokens))
    engine.check_integrity()
    graphs.eager_round_ms = eager
    graphs.part_host_ms = max(0.0, replayed - graphs.graph_ms([4, 4]))
    log.info(
        "rounds of two chains: %.2f ms eager, %.2f ms replayed (host %.2f ms beside the replay)",
        eager,
        replayed,
        graphs.part_host_ms,
    )
