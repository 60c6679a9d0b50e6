"""The verifier engine on one GPU vs the floor and HF transformers, random bf16 weights.

    PYTHONPATH=. python bench/gpu_engine.py --shape llama-8b --batch 1 8 32 64 --verify-n 4 8 16

Per shape: the floor (weight bytes / device-to-device bandwidth measured in this run), our
target-only decode step (`VerifierEngine.verify` with one pending token and no tree, CUDA graphs
and eager), the cost of verifying 1 + n tokens, with `--prefill N` a new sequence's first round
(N prompt tokens and a chain of 3 drafts), with `--newcomer N` a round of chains of 3 at each
`--verify-batch` size with such a newcomer beside them, with `--resume N` a round in which every
sequence brings N + 1 tokens (a resume round's, after the speculation gate's plain rounds; each
launched in parts, each a graph's replay, and as one launch, which no graph holds: the
verifier's `_graph_groups`), and HF
transformers' decode step on the same
weights (`generate` eager with its dynamic cache, and with a static cache, which it compiles). Each
figure is the median of `--steps` timed steps after warm-up, at a context of `--context` tokens.
`x floor with K/V`: against the weights' floor plus every sequence's K/V read once (`--context`
tokens each) at the same bandwidth, the floor that matters at long contexts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
import torch._inductor.config as inductor_config
from torch._inductor.config import decide_compile_threads
from transformers import LlamaConfig, LlamaForCausalLM

from specsplit.logit_rules import (
    Allowed,
    LogitRules,
    Penalties,
    bias_of,
    distinct,
    mask_words,
)
from specsplit.messages import NO_LOGPROBS, VerifyInput, VerifyOutput
from specsplit.model.config import ModelConfig, default_aux_layers
from specsplit.model.llama import LlamaModel, make_kv_cache, state_dict_from_hf
from specsplit.sampling import SamplingParams
from specsplit.tree import DRAFT_SUPPORT, DraftProbs, DraftTree
from verifier.engine import VerifierEngine
from verifier.rounds import VerifyRound

SHAPES = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "llama-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
    "llama-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "tiny": dict(  # CPU smoke runs of this script
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
}


def random_model(shape: str) -> tuple[LlamaForCausalLM, ModelConfig]:
    """HF's model of `shape` with random weights (seed 0), bf16 on the GPU (float32 on the CPU),
    and our config of it."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    hf_config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, rms_norm_eps=1e-5)
    with torch.device(device):
        hf = LlamaForCausalLM(hf_config).to(dtype).eval()
    return hf, ModelConfig.from_hf(hf_config)


DEVICE_TIME = ", device time"  # a row's label: the rounds' device time, not their wall time


def median_ms(fn: Callable[[], object], steps: int, warmup: int = 3) -> float:
    """Median wall time of fn() in ms; fn must end synchronised with the device."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second (CUDA events, median of 20)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times)


class EngineBench:
    def __init__(
        self, hf: LlamaForCausalLM, config: ModelConfig, args: argparse.Namespace, graphs: bool
    ) -> None:
        dtype, device = hf.dtype, hf.device
        state = state_dict_from_hf(config, hf.state_dict(), dtype, device)
        model = LlamaModel.from_state_dict(config, state, device)
        max_batch = max(args.batch)
        steps = getattr(args, "decode_steps", 1)  # tokens a decode round makes
        # room for `kv_seqs` sequences (default: the largest batch) of `kv_room` tokens past the
        # context each (default: this script's timed rounds and their warm-up)
        room = getattr(args, "kv_room", args.steps * 2 * steps + 200)
        for n in getattr(args, "resume", ()):  # each timed round (and warm-up) n + 1 more
            room = max(room, 2 * (args.steps + 3) * (n + 1) + 200)
        pages_per_seq = -(-(args.context + room) // args.page_size) + 1
        # and the chains of 3 beside a newcomer, who needs room of its own
        newcomer = (3,) if getattr(args, "newcomer", ()) else ()
        num_seqs = getattr(args, "kv_seqs", max_batch) + len(newcomer)
        kv = make_kv_cache(config, num_seqs * pages_per_seq + 8, args.page_size, dtype, device)
        # the sampled rounds' lengths too: without a graph of their length they would run the
        # eager forward (tens of ms) and say nothing of the sampled acceptance
        verify_n = sorted({*args.verify_n, *getattr(args, "sampled_n", ()), *newcomer})
        query_lens = (1, *(1 + n for n in verify_n)) if graphs else ()
        self.engine = VerifierEngine(
            model,
            kv,
            config.max_position_embeddings,
            config.vocab_size,
            graph_query_lens=query_lens,
            max_batch_size=max_batch,
            decode_ahead=getattr(args, "decode_ahead", False),
        )
        if graphs:
            start = time.perf_counter()
            self.engine.warmup()
            print(f"  graphs captured in {time.perf_counter() - start:.1f} s", flush=True)
            runner = self.engine.graphs
            assert runner is not None
            if runner.eager_round_ms is None:  # no graph holds two chains (batch 1 only)
                print("  warm-up's rounds: not timed (graph parts always pay)", flush=True)
            else:
                print(
                    f"  warm-up's rounds: {runner.eager_round_ms:.2f} ms eager, host "
                    f"{runner.part_host_ms:.2f} ms beside a replay (what parts are weighed "
                    "against)",
                    flush=True,
                )
        # each finished round's device time (VerifyRound.device_ns: CUDA events from its first
        # work to its results' copy), ms: a round's forward cost without the host's share
        self.device_ms: list[float] = []
        finish = self.engine.finish

        def finish_timed(launched: VerifyRound) -> list[VerifyOutput]:
            outputs = finish(launched)
            if launched.device_ns:
                self.device_ms.append(launched.device_ns / 1e6)
            return outputs

        self.engine.finish = finish_timed  # type: ignore[method-assign]
        self.context = args.context
        self.vocab = config.vocab_size
        # an EAGLE-3 drafter's rounds: the default layers' hidden states for every sequence
        hidden = getattr(args, "hidden_states", False)
        self.hidden_state_layers = default_aux_layers(config.num_layers) if hidden else ()
        # every sequence's ask for log-probabilities (VerifyInput.logprobs)
        self.logprobs = getattr(args, "logprobs", NO_LOGPROBS)
        self.gen = torch.Generator().manual_seed(0)
        # every sequence's logit rules (--rules): a served request's with a long output
        self.rules = self._rules() if getattr(args, "rules", False) else None
        # every sequence's guide (--guide): a mask of its own for each row of a round, or
        # (--guide-masks N) one of N masks every sequence shares, row after row
        self.guide = getattr(args, "guide", False)
        self.guide_masks = getattr(args, "guide_masks", 0)
        self._guides: dict[int, LogitRules] = {}
        self._contexts: dict[str, LogitRules] = {}  # --rules: each sequence's, through its output

    def _rules(self) -> LogitRules:
        """A 64-token bias, presence, frequency and repetition penalties, an output of 256
        distinct tokens and a prompt of the context's length."""
        output = sorted(set(self._tokens(256)))
        bias = bias_of((t, -5.0) for t in self._tokens(64))
        penalties = Penalties(bias, presence=0.5, frequency=0.5, repetition=1.1)
        counts = tuple(1 + t % 3 for t in output)
        return LogitRules(penalties, tuple(output), counts, distinct(self._tokens(self.context)))

    def _guided(self, num_rows: int) -> LogitRules:
        """Rules of a guide whose rows (a round's num_rows) each have a mask of their own (or
        one of the guide_masks), half the vocabulary allowed (made once a row count, as a
        guide's masks are once a state)."""
        if num_rows not in self._guides:
            num_masks = self.guide_masks or num_rows
            gen = torch.Generator().manual_seed(num_masks)  # (shared: the same masks each time)
            bits = torch.rand(num_masks, mask_words(self.vocab) * 32, generator=gen) < 0.5
            bits[:, self.vocab :] = False
            words = np.packbits(bits.numpy(), axis=1, bitorder="little")
            rows = tuple(r % num_masks for r in range(num_rows))
            allowed = Allowed(words[: min(num_masks, num_rows)].tobytes(), rows)
            self._guides[num_rows] = LogitRules(Penalties(), allowed=allowed)
        return self._guides[num_rows]

    def _round_rules(self, seq_id: str, num_rows: int) -> LogitRules | None:
        """A sequence's rules for a round of num_rows rows: new objects each round, as the wire
        makes them; --rules: through the output so far (`_contexts`), as the gateway carries
        them through each commit (`LogitRules.after`; a decode step run ahead under them is
        taken), the whole context on the sequence's first round with them and then only that
        the verifier keeps it (`kept_context`), as the gateway sends them (gateway/sequence.py)."""
        if self.guide:
            rules = self._guided(num_rows)
        elif self.rules is not None:
            if seq_id in self._contexts:
                return self._contexts[seq_id].kept_context()
            rules = self._contexts[seq_id] = self.rules
        else:
            return None
        output, counts, prompt = (
            tuple(list(ids)) for ids in (rules.output, rules.counts, rules.prompt)
        )
        return LogitRules(replace(rules.penalties), output, counts, prompt, rules.allowed)

    def _tokens(self, n: int) -> list[int]:
        return torch.randint(3, self.vocab, (n,), generator=self.gen).tolist()

    def open(self, batch: int, prefix: str = "s") -> dict[str, tuple[int, int]]:
        """`batch` sequences prefilled to the context, named `prefix` + index; seq id ->
        (kv_committed_len, pending)."""
        state = {}
        for b in range(batch):
            seq_id = f"{prefix}{b}"
            out = self.engine.verify(
                [VerifyInput(seq_id, True, 0, self._tokens(self.context), DraftTree())]
            )[0]
            state[seq_id] = (out.kv_committed_len, out.bonus_token)
        return state

    def step(
        self,
        state: dict[str, tuple[int, int]],
        n: int,
        decode_steps: int = 1,
        temperature: float = 0.0,
        top_p: float = 1.0,
        newcomer: int = 0,
        resume: int = 0,
    ) -> None:
        """One round for every sequence: its pending token + a chain of n random drafts (or,
        decode_steps > 1, that many decode steps). temperature > 0: sampled, each chain with
        a draft distribution cut to DRAFT_SUPPORT tokens (as the drafter sends it). newcomer:
        a new sequence of that many prompt tokens and a chain of 3 beside them, released after.
        resume: each sequence's pending token and that many more (no tree)."""
        inputs = []
        for i, (seq_id, (committed, pending)) in enumerate(state.items()):
            tree = DraftTree(self._tokens(n), list(range(-1, n - 1))) if n else DraftTree()
            if temperature and n:
                support = torch.rand(n, DRAFT_SUPPORT, generator=self.gen)
                tokens = torch.randint(3, self.vocab, (n, DRAFT_SUPPORT), generator=self.gen)
                tokens[:, 0] = torch.tensor(tree.tokens)  # each draft inside its support
                probs = support / support.sum(dim=-1, keepdim=True)
                tree.draft_probs = DraftProbs(tokens, probs, self.vocab)
            inputs.append(
                VerifyInput(
                    seq_id,
                    False,
                    committed,
                    [pending, *self._tokens(resume)],
                    tree,
                    SamplingParams(temperature, top_p=top_p, seed=i),
                    hidden_state_layers=self.hidden_state_layers,
                    decode_steps=decode_steps,
                    logprobs=self.logprobs,
                    rules=self._round_rules(seq_id, n + 1),
                )
            )
        if newcomer:
            tree = DraftTree(self._tokens(3), [-1, 0, 1])
            new = VerifyInput("newcomer", True, 0, self._tokens(newcomer), tree)
            new.hidden_state_layers = self.hidden_state_layers
            inputs.append(new)
        for out in self.engine.verify(inputs):
            if out.seq_id in state:
                state[out.seq_id] = (out.kv_committed_len, out.bonus_token)
                if out.seq_id in self._contexts:
                    self._contexts[out.seq_id] = self._contexts[out.seq_id].after(out.new_tokens)
        if newcomer:
            self.engine.release(["newcomer"])

    def prefill(self, n: int) -> None:
        """A new sequence's first round: n prompt tokens and a chain of 3 drafts; released."""
        tree = DraftTree(self._tokens(3), [-1, 0, 1])
        self.engine.verify([VerifyInput("prefill", True, 0, self._tokens(n), tree)])
        self.engine.release(["prefill"])

    def close(self, state: dict[str, tuple[int, int]]) -> None:
        self.engine.release(list(state))
        for seq_id in state:
            self._contexts.pop(seq_id, None)
        self.engine.check_integrity()
        assert self.engine.num_pages_used == 0


def hf_generate_ms(
    hf: LlamaForCausalLM, batch: int, args: argparse.Namespace, static: bool
) -> float:
    """Per new token of `generate` (greedy): (time for 2k tokens - time for k) / k. static:
    a static cache, which transformers' `generate` compiles (torch.compile) by itself."""
    ids = torch.randint(3, hf.config.vocab_size, (batch, args.context), device=hf.device)
    kwargs: dict[str, object] = dict(do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    k = args.generate_tokens

    def run(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        # (its compiles with inductor's own pool of workers: our engine, run first in this
        # process, set one thread, fused.compile_in_process; a whole model's graph has many)
        with torch.no_grad(), inductor_config.patch(compile_threads=decide_compile_threads()):
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(2 * k)  # warm-up (and compilation)
    run(2 * k)
    short = statistics.median(run(k) for _ in range(3))
    long = statistics.median(run(2 * k) for _ in range(3))
    return (long - short) / k * 1e3


def record(rows: list[tuple[str, int, float]], label: str, batch: int, ms: float) -> None:
    rows.append((label, batch, ms))
    print(f"  {label}, batch {batch}: {ms:.3f} ms", flush=True)


def record_device(
    rows: list[tuple[str, int, float]], label: str, batch: int, bench: EngineBench, steps: int
) -> None:
    """The device time of the last `steps` rounds (median; a GPU's only): `label`, device."""
    if len(bench.device_ms) >= steps:
        ms = statistics.median(bench.device_ms[-steps:])
        record(rows, label + DEVICE_TIME, batch, ms)


def round_in_parts(
    rows: list[tuple[str, int, float]],
    what: str,
    bench: EngineBench,
    batch: int,
    fn: Callable[[], object],
    graphs: bool,
    steps: int,
) -> None:
    """`fn`'s round timed as the verifier launches it (in parts where one launch would find no
    graph: `_graph_groups`; a run past the prefill graphs led in: `_lead_lens`) and, with
    graphs, as one launch (eager)."""
    record(rows, what, batch, median_ms(fn, steps))
    if graphs:
        engine = bench.engine
        engine._graph_groups = lambda inputs, others, leads: [others]  # type: ignore[method-assign]
        engine._lead_lens = lambda items: [0] * len(items)  # type: ignore[method-assign]
        ms = median_ms(fn, steps)
        del engine._graph_groups, engine._lead_lens  # the class's again
        record(rows, what + ", one launch", batch, ms)


def bench_ours(
    hf: LlamaForCausalLM, config: ModelConfig, args: argparse.Namespace, graphs: bool
) -> list[tuple[str, int, float]]:
    label = "graphs" if graphs else "eager"
    bench = EngineBench(hf, config, args, graphs)
    rows = []
    for batch in args.batch:
        state = bench.open(batch)
        decode = median_ms(lambda s=state: bench.step(s, 0), args.steps)
        record(rows, f"ours {label} decode", batch, decode)
        record_device(rows, f"ours {label} decode", batch, bench, args.steps)
        if args.decode_steps > 1:  # per token: a round's time over its steps
            k = args.decode_steps
            ms = median_ms(lambda s=state, k=k: bench.step(s, 0, k), args.steps) / k
            record(rows, f"ours {label} decode, rounds of {k} steps", batch, ms)
        if batch in args.verify_batch:
            for n in args.verify_n:
                ms = median_ms(lambda s=state, n=n: bench.step(s, n), args.steps)
                record(rows, f"ours {label} verify 1+{n}", batch, ms)
                record_device(rows, f"ours {label} verify 1+{n}", batch, bench, args.steps)
            long_runs: list[tuple[str, Callable[[], None]]] = [
                (
                    f"verify 1+3 with a newcomer of {n}",
                    lambda s=state, n=n: bench.step(s, 3, newcomer=n),
                )
                for n in args.newcomer
            ]
            long_runs += [
                (f"resume {n} + 1 tokens each", lambda s=state, n=n: bench.step(s, 0, resume=n))
                for n in args.resume
            ]
            for what, fn in long_runs:
                round_in_parts(rows, f"ours {label} {what}", bench, batch, fn, graphs, args.steps)
            for n in args.sampled_n:
                ms = median_ms(lambda s=state, n=n: bench.step(s, n, 1, 1.0), args.steps)
                record(rows, f"ours {label} sampled verify 1+{n}", batch, ms)
                if args.sampled_top_p < 1:  # the acceptance cuts each row at a threshold
                    p = args.sampled_top_p
                    ms = median_ms(
                        lambda s=state, n=n, p=p: bench.step(s, n, 1, 1.0, p), args.steps
                    )
                    record(rows, f"ours {label} sampled verify 1+{n}, top_p {p}", batch, ms)
        bench.close(state)
    for n in args.prefill:  # one at a time (a request's time to its first round)
        record(
            rows,
            f"ours {label} prefill {n} + chain 3",
            1,
            median_ms(lambda n=n: bench.prefill(n), args.steps),
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--verify-n", type=int, nargs="*", default=[4, 8, 16, 32, 64])
    parser.add_argument(
        "--verify-batch",
        type=int,
        nargs="*",
        default=[1, 8, 32],
        help="the batches of --batch that also time verify rounds",
    )
    parser.add_argument(
        "--sampled-n",
        type=int,
        nargs="*",
        default=[],
        help="also time sampled verify rounds of 1 + n tokens (temperature 1, chains with "
        "their cut draft distributions)",
    )
    parser.add_argument(
        "--sampled-top-p",
        type=float,
        default=1.0,
        help="< 1: the sampled verify rounds again with this top_p (each row's cut threshold)",
    )
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--generate-tokens", type=int, default=32)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF baselines")
    parser.add_argument(
        "--no-eager", action="store_true", help="on a GPU: CUDA graphs only (no eager rounds)"
    )
    parser.add_argument(
        "--prefill", type=int, nargs="*", default=[], help="also time a prompt of N tokens"
    )
    parser.add_argument(
        "--newcomer",
        type=int,
        nargs="*",
        default=[],
        help="also time a round of chains of 3 at each --verify-batch with a new sequence of N "
        "prompt tokens beside them (in parts, and as one launch)",
    )
    parser.add_argument(
        "--resume",
        type=int,
        nargs="*",
        default=[],
        help="also time a round at each --verify-batch in which every sequence brings N + 1 "
        "tokens (in parts, and as one launch)",
    )
    parser.add_argument(
        "--compile-batch", type=int, nargs="*", default=[1], help="HF static + compile batches"
    )
    parser.add_argument(
        "--decode-ahead",
        action="store_true",
        help="the verifier runs each decode step ahead (steps back to back: host and GPU overlap)",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=1,
        help="also time decode rounds of this many steps (VerifyInput.decode_steps), per token",
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        default=NO_LOGPROBS,
        help="every round's sequences ask for their tokens' log-probabilities and this many "
        "most likely tokens' (-1: none)",
    )
    parser.add_argument(
        "--guide",
        action="store_true",
        help="every round's sequences carry a guide's masks (guided decoding), one of its own "
        "per row (not with --decode-steps: a guided round takes one step)",
    )
    parser.add_argument(
        "--guide-masks",
        type=int,
        default=0,
        help="with --guide: the rows take one of this many masks, row after row, the same for "
        "every sequence (a guide's rows in few states; 0: a mask of its own each)",
    )
    parser.add_argument(
        "--rules",
        action="store_true",
        help="every round's sequences carry logit rules (a bias, presence, frequency and "
        "repetition penalties over a 256-token output and the context's prompt)",
    )
    args = parser.parse_args()
    if args.guide and args.decode_steps > 1:
        parser.error("--guide: a guided round takes one decode step (no --decode-steps)")

    hf, config = random_model(args.shape)
    hf_config, device, dtype = hf.config, hf.device, hf.dtype
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    if hf_config.tie_word_embeddings:
        weight_bytes += hf.lm_head.weight.numel() * hf.lm_head.weight.element_size()  # read twice
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{args.shape} on {name}, {dtype}, context {args.context}, page {args.page_size}")
    # a step also reads every sequence's K/V: per token of context, each layer's keys and values
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    kv_token_bytes = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim
    kv_token_bytes *= torch.finfo(dtype).bits // 8
    floor_ms, bandwidth = float("nan"), float("nan")
    if device.type == "cuda":
        bandwidth = copy_bandwidth(device)
        floor_ms = weight_bytes / bandwidth * 1e3
        print(
            f"weights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
            f"floor {floor_ms:.3f} ms per step; K/V {kv_token_bytes / 1024:.0f} KiB a token of "
            f"context ({args.context * kv_token_bytes / bandwidth * 1e3:.3f} ms a sequence)"
        )

    rows: list[tuple[str, int, float]] = []
    modes = (True, False) if device.type == "cuda" else (False,)  # CUDA graphs, eager
    for graphs in modes[:1] if args.no_eager else modes:
        rows += bench_ours(hf, config, args, graphs)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.no_hf and device.type == "cuda":
        for batch in args.batch:
            record(rows, "HF generate (eager)", batch, hf_generate_ms(hf, batch, args, False))
        for batch in args.compile_batch:
            ms = hf_generate_ms(hf, batch, args, True)
            record(rows, "HF generate static cache + compile", batch, ms)

    base = {b: ms for label, b, ms in rows if label == "ours graphs decode"}
    base_device = {b: ms for label, b, ms in rows if label == "ours graphs decode" + DEVICE_TIME}
    print(
        "\n| what | batch | ms per step | x floor | x floor with K/V | x ours decode (same batch) |"
    )
    print("|---|---|---|---|---|---|")
    for label, batch, ms in rows:
        against = base_device if label.endswith(DEVICE_TIME) else base  # device to device
        ratio = ms / against[batch] if batch in against else float("nan")
        kv_floor_ms = floor_ms + batch * args.context * kv_token_bytes / bandwidth * 1e3
        print(
            f"| {label} | {batch} | {ms:.3f} | {ms / floor_ms:.2f} | {ms / kv_floor_ms:.2f} "
            f"| {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
