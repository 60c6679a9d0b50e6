"""The command line's engine and generation flags (model, verifier, drafter, spec, sampling):
each group a function adding its flags to a subcommand's parser (`specsplit/cli_args.py`'s
`flag` / `switch`: defaults from SPECSPLIT_* environment variables), the defaults' measured
reasons, and what the serve commands read back from them (spec, graph sizes). Listener,
round lane, limit and security flags: `specsplit/cli_server_flags.py`.

Service modules are imported inside the functions that need them: the command line starts
without torch (--help, `generate`).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from specsplit.cli_args import (
    comma_separated,
    flag,
    milliseconds,
    optional_float,
    optional_int,
    optional_str,
    positive_int,
    switch,
)
from specsplit.lookup import LOOKUP_MIN_NGRAM, MAX_NGRAM

if TYPE_CHECKING:
    from specsplit.spec_params import SpecParams

DRAFTER_KINDS = ("auto", "ngram", "self", "model", "eagle3")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# --idle-poll-ms's default on a GPU: SmolLM2 rounds through `up` at batch 1, polling against
# asleep, 1.13x tok/s over five pairs on one H200 and 1.11x serial on two (batch 8 1.03x, 32
# 0.98x: within the runs' spread); bench/RESULTS.md, seventy-third session
IDLE_POLL_MS_ON_GPU = 20.0
DRAFTER_KV_MEMORY_FRACTION = 0.8  # the drafter on a GPU of its own
SHARED_DRAFTER_KV_MEMORY_FRACTION = 0.1  # `up` with the drafter on the verifier's GPU


ENGINE_CALLS = ("auto", "thread", "loop")
# --decode-ahead-max-batch (verifier/engine.py `_launch_ahead`): through the services on one
# H100 (random SmolLM2, target-only rounds, bench/RESULTS.md) decode ahead gave 1.29x at 1
# stream, 1.56x / 1.85x at 8, 1.25x at 16; at 32 one-step rounds disagreed (0.86x, 0.90x,
# 1.47x). With rounds of several steps (which always run their own further steps ahead) the
# step after a round's last, run ahead at 32 streams against not, gave 1.14x, 1.04x, 1.08x
# (rounds of 4), 0.93x, 1.13x (rounds of 8) and 1.08x with adaptive rounds (H200s, the
# forty-eighth and forty-ninth sessions; the last with every run of five faster): the device
# works through the trip between rounds instead of waiting 3.4 ms a round. One-step rounds at
# 17-64 sequences (--decode-steps 1, serve-gateway's default) were not measured again at it
DECODE_AHEAD_MAX_BATCH = 64
# --graph-max-batch: the largest batch the drafter's and the verifier's CUDA graphs are captured
# for (a larger round runs eagerly, host-bound); `up` raises it to --max-batch-size
GRAPH_MAX_BATCH = 64
# --max-batch-size: through `up` on two H200s (SmolLM2-135M, sixty-second session, bench/serving.py)
# 64 against 32 streamed 2.13x the tokens a second with 256 requests all at once (random weights;
# TTFT p50 0.36x, TPOT unchanged) and, with the real weights and the speculation gate on (`up`'s
# default), 1.38x all at once (TTFT p50 0.31x) and the same at 20 requests a second; 128 streamed
# 2.04x with twice 64's time per output token
MAX_BATCH_SIZE = 64
MAX_AHEAD_DEPTH = 3  # --decode-ahead-depth (verifier/ahead_depth.py)
# --decode-ahead-depth: on two H200s (random SmolLM2, target only, fifty-eighth session) 2 steps
# against 1 streamed 1.00x / 1.01x / 1.11x the tokens a second under Poisson arrivals of 20 / 80
# requests a second and all at once, with a lower time per output token at each, and 0.95x /
# 1.09x / 1.03x at 1 / 8 / 32 closed streams (medians of 4-5 `up`s); auto (0) met the split goal
# but doubled 80/s's TTFT p90 (three steps queued behind a round a newcomer waits for)
DECODE_AHEAD_DEPTH = 2
# --chain-max-batch (verifier/hinted_rounds.py `hint_next`): through the services on two H100s (8B
# target, 1B draft, draft-ahead, synthetic acceptance, bench/RESULTS.md) chained rounds gave
# 1.07x / 1.08x at 1 stream (two runs) but 0.93x at 8 and 0.91x at 32, where the hint comes late
# in the round and the chaining's host work holds its answer back; 2-4 not measured yet
CHAIN_MAX_BATCH = 1
# --chain-min-guess-rate: a chained round whose outcome the hint did not guess is dropped after
# the device ran it (a whole verify lost), one guessed saves the device's wait between rounds
# (0.3-0.8 ms at batch 1 against a 6.4 ms verify, 8B target on an H100: bench/RESULTS.md), so
# chaining pays only where nearly every outcome is guessed (break-even there ~0.9); draft-ahead
# with the shipped SmolLM2 head guessed 29-49% of rounds. With misses run plain (the gateway's
# default, --ahead-miss plain) a miss is placed as the plain round and counts as guessed
CHAIN_MIN_GUESS_RATE = 0.9
# --decode-steps auto with the verifier on a GPU (gateway/scheduler.py, VerifyInput.decode_steps)
DECODE_STEPS_ON_GPU = 4
# --decode-lookup auto with the verifier on the CPU (gateway/scheduler.py, VerifyInput.lookup)
DECODE_LOOKUP_ON_CPU = 3
# --prefill-chunk auto with the verifier on the CPU (gateway/sequence.py, Sequence.prefilling):
# ~0.5 s of the embedded default's prefill on the 2-core VM (bench/RESULTS.md)
PREFILL_CHUNK_ON_CPU = 512
# gateway/decode_steps.py's QUIET_SECONDS in ms (not imported: the parser is built before the
# services quiet tqdm, and the gateway's modules import torch)
DECODE_STEPS_QUIET_MS = 100.0


def model_flags(parser: argparse.ArgumentParser, *, engine: bool = True) -> None:
    flag(parser, "--model", None, "target checkpoint (directory or .gguf); default: embedded")
    if not engine:
        return
    flag(parser, "--device", "auto", "torch device; auto = cuda when available")
    dtype_help = "weights and KV dtype; auto = bfloat16 on cuda, float32 on cpu"
    flag(parser, "--dtype", "auto", dtype_help, choices=DTYPE_CHOICES)
    flag(parser, "--num-pages", None, "KV cache pages; none = the engine's", type=optional_int)
    flag(parser, "--page-size", 16, "tokens per KV page", type=positive_int)
    calls_help = (
        "drafter and verifier: where engine calls run: thread (a thread of the engine's own),"
        " loop (the event loop's thread: two thread wake-ups fewer per round, the loop blocked"
        " during a call) or auto (loop on a GPU, thread on the CPU)"
    )
    flag(parser, "--engine-calls", "auto", calls_help, choices=ENGINE_CALLS)
    poll_help = (
        "drafter and verifier: how long the event loop keeps polling its round lane after an"
        " answer before it sleeps (a service asleep between rounds wakes late); 0 = never;"
        f" none = {IDLE_POLL_MS_ON_GPU:g} on a GPU (batch-1 rounds 1.13x faster on an H200),"
        " 0 on the CPU (the engine needs the cores)"
    )
    flag(parser, "--idle-poll-ms", None, poll_help, type=optional_float)
    graph_batch_help = (
        "drafter and verifier: the largest batch their CUDA graphs are captured for (on a"
        " GPU; a larger round runs eagerly, host-bound), at most 256; `up` passes the larger of"
        " it and --max-batch-size"
    )
    flag(parser, "--graph-max-batch", GRAPH_MAX_BATCH, graph_batch_help, type=graph_max_batch)


def verifier_flags(parser: argparse.ArgumentParser) -> None:
    lens_help = (
        "query tokens per sequence of the verify steps captured as CUDA graphs on a GPU "
        "(1 = decode, 1 + num_draft_tokens = verify), comma-separated; none = always eager"
    )
    flag(parser, "--cuda-graphs", "1,4,5,9,17", lens_help)
    fraction_help = "share of the GPU memory free after loading the weights for the KV cache"
    flag(
        parser,
        "--kv-memory-fraction",
        0.8,
        fraction_help + " (when --num-pages is not set)",
        type=float,
    )
    kv_help = (
        "the verifier's KV cache: auto = the model's dtype; float16 = K and V rounded to float16"
        " as they are stored (on the CPU under a float32 model only): half the memory and half"
        " the bytes a long context's step reads, the outputs those of the model with that cache"
        " (speculative and target-only rounds alike)"
    )
    flag(parser, "--kv-dtype", "auto", kv_help, choices=("auto", "float16"))
    ahead_help = (
        "after a round of decode steps (no drafts), run the same sequences' next decode"
        " step before it is asked for, and keep it when the next round is that step: the GPU"
        " computes while the answer travels and the gateway works; auto = on with CUDA graphs"
        " on a GPU (elsewhere the step cannot run beside the host's work)"
    )
    flag(parser, "--decode-ahead", "auto", ahead_help, choices=("auto", "on", "off"))
    flag(
        parser,
        "--decode-ahead-max-batch",
        DECODE_AHEAD_MAX_BATCH,
        "--decode-ahead only for rounds of at most this many sequences (a round's own further"
        " --decode-steps at any batch)",
        type=int,
    )
    flag(
        parser,
        "--decode-ahead-depth",
        DECODE_AHEAD_DEPTH,
        "--decode-ahead: decode steps run ahead after a round's last step, each behind the one"
        f" before (1 to {MAX_AHEAD_DEPTH}); 0 = auto: as many as cover the trip between rounds"
        " (the answer, the gateway's work, the next request) and the next step's launch,"
        " measured against a step's GPU time per batch size. Default 2: on two H200s it streamed"
        " 1.00-1.11x depth 1's tokens a second under Poisson arrivals, where auto's queued"
        " steps cost newcomers' first tokens (bench/RESULTS.md)",
        type=int,
    )
    chain_help = (
        "with the gateway's draft-ahead hints and the engine's calls on the event loop (a"
        " GPU's): queue the hinted next round on the GPU right behind the round in flight,"
        " placed on the outcome that came by two device kernels (no wait between the rounds),"
        " instead of launching it once the round is answered; auto = while a round's device"
        " time is at least twice a chain's host work, both measured (an 8B target's rounds,"
        " not SmolLM2's: bench/RESULTS.md)"
    )
    flag(parser, "--chain-rounds", "auto", chain_help, choices=("auto", "on", "off"))
    flag(
        parser,
        "--chain-max-batch",
        CHAIN_MAX_BATCH,
        "--chain-rounds only for rounds of at most this many sequences",
        type=int,
    )
    flag(
        parser,
        "--chain-min-guess-rate",
        CHAIN_MIN_GUESS_RATE,
        "--chain-rounds only while at least this share of the last rounds with a hint had their"
        " outcome among the hint's, or a miss the hint runs plain (a chained round whose outcome"
        " was missed otherwise costs the device a whole round); 0 = always",
        type=float,
    )
    flag(
        parser,
        "--lookup-min-ngram",
        LOOKUP_MIN_NGRAM,
        "the prompt-lookup chains the verifier drafts in decode steps (the gateway's"
        " --decode-lookup) follow a suffix of at least this many of the sequence's tokens that"
        " occurred before (1 also takes one-token matches: on SmolLM2's chat answers 10%% of"
        " their tokens were accepted, 70%% after three-token matches)",
        type=int,
        choices=range(1, MAX_NGRAM + 1),
    )
    synthetic_help = (
        "BENCHMARKS ONLY, NOT LOSSLESS: accept the first child at depth d with the d-th of these"
        " comma-separated rates (the last for deeper levels) instead of the target's choice, so"
        " random-weight models run the whole system at a chosen accepted length; none = off"
    )
    flag(parser, "--synthetic-acceptance", None, synthetic_help, type=synthetic_rates)


def synthetic_rates(value: str) -> tuple[float, ...] | None:
    """--synthetic-acceptance's rates: none, or comma-separated probabilities."""
    rates = comma_separated(value, float, "comma-separated rates")
    if rates is None:
        return None
    if not all(0.0 <= rate <= 1.0 for rate in rates):
        raise argparse.ArgumentTypeError(f"rates are probabilities in [0, 1]: {value!r}")
    return rates


def decode_ahead(args: argparse.Namespace, device: str) -> bool:
    """--decode-ahead resolved for a verifier on `device`."""
    if args.decode_ahead == "auto":
        return device.startswith("cuda") and bool(graph_query_lens(args))
    return bool(args.decode_ahead == "on")


def graph_max_batch(value: str) -> int:
    """--graph-max-batch's value: an integer in [1, 256] (the largest of the graphs' buckets,
    specsplit/model/cuda_graphs.py BATCH_SIZES)."""
    size = positive_int(value)
    if size > 256:
        raise argparse.ArgumentTypeError(f"{size} is not in [1, 256]")
    return size


def graph_query_lens(args: argparse.Namespace, name: str = "cuda_graphs") -> tuple[int, ...]:
    """The query lengths of a --cuda-graphs / --draft-cuda-graphs flag (`name`)."""
    value, flag_name = getattr(args, name), "--" + name.replace("_", "-")
    if value in ("", "none"):
        return ()
    try:
        lens = tuple(sorted({int(x) for x in value.split(",")}))
    except ValueError as e:
        raise SystemExit(f"{flag_name} {value!r}: comma-separated integers") from e
    if not all(0 < n <= 256 for n in lens):
        raise SystemExit(f"{flag_name} {value!r}: each in [1, 256]")
    return lens


def drafter_flags(parser: argparse.ArgumentParser) -> None:
    kind_help = (
        "auto (eagle3 with the shipped head on the embedded default target drafting on a GPU,"
        " else ngram), "
        "ngram (prompt lookup), self (target's first --draft-layers), model (--draft-model), "
        "eagle3 (--draft-model = an EAGLE head for --model: EAGLE-3, or the single-layer "
        "EAGLE-1/2 layout, detected from the checkpoint)"
    )
    flag(parser, "--drafter", "auto", kind_help, choices=DRAFTER_KINDS)
    model_help = (
        "draft checkpoint (--drafter model) or EAGLE head (eagle3; on the embedded target the "
        "shipped head by default)"
    )
    flag(parser, "--draft-model", None, model_help)
    flag(parser, "--draft-layers", None, "layers for --drafter self", type=optional_int)
    graphs_help = (
        "catch-up lengths (a round's new tokens per sequence, padded up to one of these) of the"
        " draft steps captured as CUDA graphs on a GPU, with the chain's one-token steps;"
        " comma-separated; none = always eager"
    )
    flag(parser, "--draft-cuda-graphs", "1,2,4,8", graphs_help)
    fraction_help = (
        "share of the drafter GPU's memory free after loading its weights for its KV cache"
        " (an EAGLE head's: with the target's feature rows beside it)"
        f" (when --num-pages is not set); none = {DRAFTER_KV_MEMORY_FRACTION}, or with `up`"
        f" {SHARED_DRAFTER_KV_MEMORY_FRACTION} when the drafter shares the verifier's GPU"
    )
    flag(parser, "--draft-kv-memory-fraction", None, fraction_help, type=optional_float)


def spec_flags(parser: argparse.ArgumentParser) -> None:
    flag(parser, "--num-steps", 3, "default draft depth; 0 = no drafting", type=int)
    flag(parser, "--topk", 1, "default children per draft node; 1 = a chain", type=int)
    nodes_help = "default draft tree nodes; none = num_steps * topk"
    flag(parser, "--num-draft-tokens", None, nodes_help, type=optional_int)
    flag(parser, "--max-batch-size", MAX_BATCH_SIZE, "sequences per round", type=positive_int)
    switch(
        parser,
        "--adaptive-spec",
        False,
        "move each request's draft shape along --adaptive-ladder by its acceptance; requests"
        " with their own spec stay fixed",
    )
    ladder_help = "--adaptive-spec rungs STEPS[xTOPK[xNODES]],... (plus the default shape)"
    ladder_help += "; none = 1,3,5,5x4x16"
    flag(parser, "--adaptive-ladder", None, ladder_help, type=optional_str)
    overlap_help = (
        "serial (draft, then verify, the whole batch), groups (two groups take turns: one is"
        " verified while the other is drafted), gated (groups, ahead or serial rounds, whichever"
        " commits the most tokens per second, measured per batch size), ahead (draft-ahead: while a"
        " round is verified, the drafter drafts the next round's trees for its likely"
        " outcomes; greedy chains), both (ahead while at most --ahead-max-batch requests run,"
        " groups above) or auto (`up`: gated when the drafter and the verifier run on two"
        " different GPUs, else serial; serve-gateway, which cannot see the devices: serial)"
    )
    modes = ("auto", "serial", "groups", "gated", "ahead", "both")
    flag(parser, "--overlap", "auto", overlap_help, choices=modes)
    switch(
        parser,
        "--early-verify",
        None,
        "--overlap groups: send the other group's Verify as soon as its trees are drafted,"
        " while this group's is verified (the verifier's GPU runs the two back to back); with"
        " --overlap gated the gate measures groups with it (groups-early) and without it."
        " auto: `up` turns it on when the drafter and the verifier run on two different GPUs"
        " (two H100s: 1.25x / 1.38x groups without it at batch 8 / 32 with an 8B-shaped"
        " target; with SmolLM2 0.65x / 0.73x in one run, 1.10x / 1.02x in the next),"
        " serve-gateway, which cannot see the devices, leaves it off",
    )
    flag(
        parser,
        "--ahead-guesses",
        2,
        "--overlap ahead: bonus tokens guessed per accept length (the drafter drafts a tree for"
        " each)",
        type=int,
    )
    miss_help = (
        "--overlap ahead: a round whose outcome was not guessed drafts first (draft) or is"
        " verified with no tree at once (plain: a decode step while its next trees are drafted"
        " ahead, so that no Draft waits before a Verify)"
    )
    flag(parser, "--ahead-miss", "plain", miss_help, choices=("draft", "plain"))
    verify_ahead_help = (
        "--overlap ahead: send the trees drafted ahead to the verifier as they come, so that it"
        " runs each sequence's next round as soon as this one commits, before the gateway asks"
        " (the round trip through the gateway off the verifier's path); off: only in the next"
        " Verify"
    )
    flag(parser, "--verify-ahead", "on", verify_ahead_help, choices=("on", "off"))
    flag(
        parser,
        "--ahead-max-batch",
        4,
        "--overlap both: rounds draft ahead while at most this many requests run, groups above",
        type=int,
    )
    gate_help = (
        "requests without their own spec draft only while speculating commits more tokens per"
        " second than plain rounds, measured per batch size (on), always (off), or auto (`up`:"
        " on, on every device: whether speculation beats the target alone depends on the"
        " model, the device, the drafter and the prompts; serve-gateway: off)"
    )
    flag(parser, "--speculation-gate", "auto", gate_help, choices=("auto", "on", "off"))
    steps_help = (
        "tokens a plain round (no drafts, no target features) decodes in one Verify: the"
        " verifier runs the further decode steps itself, so the round trip through the gateway"
        " is paid once for them (the stop rules cut what comes past a stop); none = auto (`up`:"
        f" {DECODE_STEPS_ON_GPU} when the verifier runs on a GPU, else 1; serve-gateway: 1)"
    )
    flag(parser, "--decode-steps", None, steps_help, type=optional_int)
    adaptive_help = (
        "plain rounds grow from --decode-steps, per batch size, up to 16 steps while the"
        " verifier's device idles between rounds more than a tenth of its busy time (the trip"
        " through the gateway its step run ahead does not cover; measured, so each machine finds"
        " its own: gateway/decode_steps.py); off = every plain round takes --decode-steps; auto"
        " (`up`: on when the verifier runs on a GPU and --decode-steps is not given; serve-gateway,"
        " which cannot see the devices: off)"
    )
    switch(parser, "--decode-steps-adaptive", None, adaptive_help)
    lookup_help = (
        "each decode step of a plain round verifies a chain of up"
        " to this many tokens the verifier drafts by prompt lookup from the sequence's own"
        " tokens (what followed an earlier occurrence of its last 2-3 tokens, the verifier's"
        " --lookup-min-ngram): a step then"
        " appends its accepted drafts and a bonus token, with no drafter, RPC or gateway trip"
        " between steps; same output (greedy: the same tokens; sampled: the same distribution);"
        f" 0 = plain steps; none = auto (`up`: {DECODE_LOOKUP_ON_CPU} when the verifier runs on"
        " a CPU, else 0; serve-gateway: 0)"
    )
    flag(parser, "--decode-lookup", None, lookup_help, type=optional_int)
    lookup_batch_help = (
        "--decode-lookup only in rounds of at most this many sequences: a step's chains cost"
        " verify rows for every sequence, paid back only where they are accepted (on the 2-core"
        " VM chat questions ran 1.07x with lookup at 1 stream, 0.99x / 0.94x / 0.90x at 2 / 4 /"
        " 8, edits of given text 1.39-1.47x at 1, 1.18x / 1.03x / 0.93x at 2 / 4 / 8)"
    )
    flag(parser, "--decode-lookup-max-batch", 2, lookup_batch_help, type=int)
    chunk_help = (
        "a prompt (or a sequence the verifier must take again) longer than this many tokens"
        " goes to the verifier this many tokens a round, with the other requests' rounds, until"
        " the rest fits one round: the requests decoding beside it wait one chunk's prefill, not"
        " the whole prompt's (on the 2-core VM a 3,000-token prompt's prefill takes ~7 s); same"
        f" output; 0 = the whole prompt in one round; none = auto (`up`: {PREFILL_CHUNK_ON_CPU}"
        " when the verifier runs on a CPU, else 0; serve-gateway: 0)"
    )
    flag(parser, "--prefill-chunk", None, chunk_help, type=optional_int)
    quiet_help = (
        "with --decode-steps-adaptive: plain rounds grow only once no request arrived for this"
        " long (a request arriving during a round waits for its end: under steady arrivals"
        " grown rounds gave 2.4-3.4x the time to first token of rounds of 4, bench/serving.py);"
        " 0 = regardless of arrivals"
    )
    flag(parser, "--decode-steps-quiet-ms", DECODE_STEPS_QUIET_MS, quiet_help, type=milliseconds)
    prefill_help = (
        "a round that starts a request (its prefill) decodes one step for every request in it,"
        " so the new request's first token streams after that step, not after the others'"
        " further decode steps (--decode-steps); costs the others a round trip. Under Poisson"
        " arrivals through `up` on two H200s it cut the time to first token (p50) to"
        " 0.68-0.83x at the same tokens a second (bench/RESULTS.md). Not while requests wait for"
        " a place in the batch"
    )
    switch(parser, "--prefill-rounds-one-step", True, prefill_help)


def generation_flags(parser: argparse.ArgumentParser) -> None:
    flag(parser, "--max-tokens", 256, "most tokens to generate", type=int)
    flag(parser, "--temperature", 0.0, "0 = greedy", type=float)
    flag(parser, "--top-p", 1.0, "nucleus mass in (0, 1]", type=float)
    flag(parser, "--top-k", 0, "0 = off", type=int)
    flag(parser, "--seed", None, "sampling seed; none = random", type=optional_int)
    parser.add_argument("--stop", action="append", help="stop at this string (repeatable)")
    switch(parser, "--chat", True, "send the prompt as a user chat message")


# -- what the serve commands read -----------------------------------------------------------


def default_spec(args: argparse.Namespace) -> SpecParams:
    from specsplit.spec_params import SpecParams

    nodes = args.num_draft_tokens
    if nodes is None:
        nodes = args.num_steps * args.topk
    return SpecParams(num_steps=args.num_steps, topk=args.topk, num_draft_tokens=nodes)


def adaptive_rungs(args: argparse.Namespace) -> tuple[SpecParams, ...] | None:
    """The --adaptive-ladder rungs; None = gateway.adaptive's default ladder."""
    from gateway.adaptive import parse_ladder

    return None if args.adaptive_ladder is None else parse_ladder(args.adaptive_ladder)
