"""The Prometheus metrics the services export: each one's name, help text, labels and buckets.

Gateway: speculation (accepted tokens per round, accepted drafts by depth), generated tokens
(tokens/s = rate), TTFT, inter-token latency, running / waiting sequences, and the draft and
verify round trips as the gateway sees them; sessions (open, their KV pages, evictions, tokens
reused per turn). Drafter / verifier: their own draft / verify time on the engine thread and
their KV pages. All three: RPCs that ended in an error, by gRPC code; garbage-collector pauses.
Recorded through specsplit/metrics.py, which also serves them.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

ACCEPTED_TOKENS_PER_ROUND = Histogram(
    "specsplit_accepted_tokens_per_round",
    "num_accepted_tokens (accepted drafts + bonus) of one sequence in one round",
    buckets=tuple(range(1, 17)),
)
DECODE_STEPS = Histogram(
    "specsplit_decode_steps",
    "Decode steps a plain round asked for, with --decode-steps-adaptive (grown per batch size"
    " while the verifier's device idles between rounds, once no request arrived for"
    " --decode-steps-quiet-ms)",
    buckets=(1, 2, 4, 8, 12, 16),
)
ACCEPTED_DRAFTS = Counter(
    "specsplit_accepted_drafts",
    "Accepted draft tokens, by their depth in the draft tree (1 = the root's child)",
    ["depth"],
)
DRAFT_SECONDS = Histogram(
    "specsplit_draft_seconds",
    "A draft round: engine time on the drafter, round trip on the gateway",
    buckets=_LATENCY_BUCKETS,
)
VERIFY_SECONDS = Histogram(
    "specsplit_verify_seconds",
    "A verify round: engine time on the verifier, round trip on the gateway",
    buckets=_LATENCY_BUCKETS,
)
VERIFY_DEVICE_SECONDS = Histogram(
    "specsplit_verify_device_seconds",
    "On the verifier's GPU, a verify round's own device time (CUDA events from its first device"
    " work to its results' copy, VerifyResponse.device_ns): its sum over the wall is the GPU's"
    " busy fraction",
    buckets=_LATENCY_BUCKETS,
)
_OVERHEAD_BUCKETS = (
    0.0001, 0.0002, 0.0003, 0.0004, 0.0006, 0.0008, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01,
    0.025, 0.05, 0.1,
)  # fmt: skip
RPC_OVERHEAD_SECONDS = Histogram(
    "specsplit_rpc_overhead_seconds",
    "A round's RPC on the gateway (protobuf both ways, transport, the service's hand-off to its"
    " engine thread) less the engine time the service reports",
    ["service"],
    buckets=_OVERHEAD_BUCKETS,
)
RPC_STAGE_SECONDS = Histogram(
    "specsplit_rpc_stage_seconds",
    "A round's RPC on the gateway by stage, on the round lane (one host, one clock): build (the"
    " request's message and bytes), request (until the service had read it: the hop and the"
    " service's wake-up), service (its parse, engine call and response built), response (its"
    " serialization and the hop back, until the gateway had read its last byte), wake (until"
    " the round's task on the gateway went on), parse (the answer converted)",
    ["service", "stage"],
    buckets=_OVERHEAD_BUCKETS,
)
RPC_STAGES = ("build", "request", "service", "response", "wake", "parse")
SERVICE_OVERHEAD_SECONDS = Histogram(
    "specsplit_service_overhead_seconds",
    "A round on a drafter or verifier from its request read to its response ready, less the"
    " engine time (protobuf both ways, the hand-off to the engine thread and back)",
    buckets=_OVERHEAD_BUCKETS,
)
ROUND_SECONDS = Histogram(
    "specsplit_round_seconds", "A round on the gateway, wall time", buckets=_LATENCY_BUCKETS
)
ROUNDS = Counter(
    "specsplit_rounds",
    "Rounds the gateway ran by kind: 'plain' (no sequence drafted: target-only requests, or the"
    " speculation gate holding drafts back) or a speculating round's (`serial`, `groups`,"
    " `groups-early`, `ahead`, `ahead-plain`, `ahead-unhinted`: what the overlap gate, or"
    " --overlap, ran it as)",
    ["kind"],
)
ROUND_OUTSIDE_VERIFY_SECONDS = Histogram(
    "specsplit_round_outside_verify_seconds",
    "A round's critical path outside the verifier's engine time (drafting not hidden, both RPCs,"
    " the gateway's own work)",
    buckets=_OVERHEAD_BUCKETS,
)
ROUND_OUTSIDE_DEVICE_SECONDS = Histogram(
    "specsplit_round_outside_device_seconds",
    "A round's wall time on the gateway less the verifier's device time for it (CUDA events, its"
    " first work to its results' copy, however early it ran: on a hint, chained behind the round"
    " before): the round's critical path outside the verifier's GPU, where work done beside the"
    " device's rounds counts not at all and host work while the device idles does (a GPU only)",
    buckets=_OVERHEAD_BUCKETS,
)
VERIFIER_WAIT_SECONDS = Histogram(
    "specsplit_verifier_wait_seconds",
    "On the verifier: from a round's finish (its results ready; a round of several decode steps:"
    " its last step's) to the next round of the same"
    " sequences queued on the device, where nothing was queued behind it: what the device waits"
    " for the answer's trip, the gateway and the next request (0: a round or decode step run"
    " ahead followed)",
    buckets=(0.0, *_OVERHEAD_BUCKETS),
)
VERIFIER_IDLE_SECONDS = Histogram(
    "specsplit_verifier_idle_seconds",
    "On the verifier's GPU, from the CUDA event timestamps: its idle time from the end of a round"
    " (its results' copy) to the start of the next round launched (its first device work, after"
    " its host building: the device idles there) where the two"
    " share a sequence, however the next launched (on the request, on the gateway's hint, or"
    " chained behind the round in flight); the device's own view of the wait between rounds",
    buckets=(0.0, *_OVERHEAD_BUCKETS),
)
VERIFIER_STEP_IDLE_SECONDS = Histogram(
    "specsplit_verifier_step_idle_seconds",
    "On the verifier's GPU, from the CUDA event timestamps: its idle time before each further"
    " decode step of a round of several (--decode-steps) launched within the round, where the"
    " host prepares each step while the one before runs; the rest of"
    " specsplit_verifier_idle_seconds falls between rounds (the step launched when the round's"
    " request came, behind a first step run ahead before it, included)",
    buckets=(0.0, *_OVERHEAD_BUCKETS),
)
VERIFIER_GAP_SECONDS = Histogram(
    "specsplit_verifier_gap_seconds",
    "On the verifier, the host work in its device's wait between rounds, by phase: 'finish' (a"
    " round's results read and committed once the device is done, every round), and where the"
    " next round launches on the gateway's hint, from that finish to the hinted launch: 'answer'"
    " (the hint had come: the answer built and written first) or 'hint' (the hint came after"
    " the finish: how late it was), then 'launch' (the hinted round's host work until it is"
    " queued on the device); and 'chain': a hinted round chained on the"
    " device behind the round in flight (its host work, done while the device runs that round:"
    " it leaves no wait)",
    ["phase"],
    buckets=_OVERHEAD_BUCKETS,
)
SPECULATING = Gauge(
    "specsplit_speculating",
    "1 while the speculation gate lets rounds at this batch size draft, 0 while it holds them"
    " back (plain rounds pay more there)",
    ["batch_bucket"],
)
OVERLAP_MODE = Gauge(
    "specsplit_overlap_mode",
    "1 for the round kind (groups, ahead, serial) the overlap gate runs speculating rounds as at"
    " this batch size (it commits the most tokens per second there), 0 for the others",
    ["batch_bucket", "mode"],
)
# the speculation gate's rounds by kind (unlabelled histograms: bench/overlap.py reads exact means
# from their sums): speculating, plain, and resuming (a round whose sequences' features are
# caught up first, the gate having held them back)
GATE_ROUND_KINDS = ("speculating", "plain", "resuming")
GATE_ROUND_SECONDS = {
    kind: Histogram(
        f"specsplit_gate_{kind}_round_seconds",
        f"A round on the gateway the speculation gate made {kind}, wall time",
        buckets=_LATENCY_BUCKETS,
    )
    for kind in GATE_ROUND_KINDS
}
GENERATED_TOKENS = Counter(
    "specsplit_generated_tokens", "Tokens streamed to clients (tokens/s: rate of this)"
)
TIME_TO_FIRST_TOKEN = Histogram(
    "specsplit_time_to_first_token_seconds",
    "From a request's arrival at the scheduler to its first streamed token",
    buckets=_TTFT_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "specsplit_inter_token_latency_seconds",
    "Between streamed tokens after the first chunk; tokens of one chunk share its gap evenly",
    buckets=_LATENCY_BUCKETS,
)
RUNNING_SEQUENCES = Gauge("specsplit_running_sequences", "Sequences in the round batch")
WAITING_SEQUENCES = Gauge("specsplit_waiting_sequences", "Sequences queued for the batch")
KV_PAGES_USED = Gauge("specsplit_kv_pages_used", "KV cache pages holding sequences")
KV_PAGES_FREE = Gauge("specsplit_kv_pages_free", "KV cache pages free")
RULE_ROWS_BYTES = Gauge(
    "specsplit_rule_rows_bytes",
    "Device memory held for sequences' logit-rules rows (bias, counts, prompt tokens; the "
    "drafter's also a guide's root masks), outside the KV pool",
)
ERRORS = Counter("specsplit_errors", "RPCs that ended with an error status", ["code"])
PREEMPTIONS = Counter(
    "specsplit_preemptions", "Running sequences retracted because the verifier's KV was full"
)
DRAFT_AHEAD = Counter(
    "specsplit_draft_ahead",
    "Rounds of draft-ahead sequences (--overlap ahead) by whether the tree drafted ahead for "
    "the last round's outcome was there ('hit': no Draft on the round's path) or not ('miss')",
    ["outcome"],
)
DECODE_AHEAD = Counter(
    "specsplit_decode_ahead",
    "Verifier decode steps run before they were asked for (--decode-ahead), by whether the next"
    " round was that step ('used': its answer waited only for the GPU) or not ('dropped': a"
    " step of GPU time spent for nothing)",
    ["outcome"],
)
VERIFIER_FORWARDS = Counter(
    "specsplit_verifier_forwards",
    "The verifier's forwards (each part of a round, each decode step run ahead or further) by"
    " path: 'graph' (a CUDA graph's replay) or 'eager' (no captured graph holds it, host-bound"
    " on a GPU: tens of ms; or none captured, as on the CPU)",
    ["path"],
)
VERIFIER_EAGER_FORWARDS = Counter(
    "specsplit_verifier_eager_forwards",
    "The verifier's eager forwards by why no CUDA graph ran them: 'no graphs' (none captured:"
    " the CPU, --cuda-graphs off), 'batch' (more sequences than the largest bucket), 'context'"
    " (a page table past the graphs'), 'run' (a sequence's new tokens past every captured q with"
    " a bucket for the batch), 'rows' (device inputs that would need padding rows)",
    ["why"],
)
VERIFIER_LOOKUP_TOKENS = Counter(
    "specsplit_verifier_lookup_tokens",
    "Prompt lookup's drafts in the verifier's decode steps (--decode-lookup): 'drafted' (the"
    " chains' tokens verified) and 'accepted' (those the target kept: each a step saved)",
    ["outcome"],
)
VERIFIER_RULES_ROUNDS = Counter(
    "specsplit_verifier_rules_rounds",
    "The verifier's rounds and decode steps bent by logit rules or a guide, by path: 'graph' (one"
    " rules graph's replay, verifier/rules_graphs.py) or 'eager' (the bending's kernels launched"
    " one by one: ~0.1-0.3 ms more host a round on a GPU)",
    ["path"],
)
VERIFIER_EAGER_RULES_ROUNDS = Counter(
    "specsplit_verifier_eager_rules_rounds",
    "The verifier's rules rounds bent eagerly, by why: 'no graphs' (the CPU, --cuda-graphs off,"
    " SPECSPLIT_RULES_GRAPHS=0), 'logits' (the forward ran eagerly or gathered its rows),"
    " 'refill' (a sequence's first round under its rules, or min_tokens holding stop tokens"
    " back), 'masks' (a guide's masks past a graph's cap)",
    ["why"],
)
DRAFTER_FORWARDS = Counter(
    "specsplit_drafter_forwards",
    "The drafter's device runs by path: each forward of catch-up or root steps, and each tree"
    " expansion run (its catch-up inside it or not), 'graph' (a CUDA graph's replay) or 'eager'"
    " (host-bound on a GPU)",
    ["path"],
)
DRAFTER_EAGER_FORWARDS = Counter(
    "specsplit_drafter_eager_forwards",
    "The drafter's eager forwards by why no CUDA graph ran them (as the verifier's:"
    " specsplit_verifier_eager_forwards); 'run' most often a newcomer's prompt caught up beside"
    " the others' few tokens",
    ["why"],
)
DECODE_AHEAD_DROPPED = Counter(
    "specsplit_decode_ahead_dropped",
    "Verifier decode steps run ahead and dropped, by why (verifier/run_ahead.py DROP_REASONS):"
    " 'unasked' (the next round took none of it), 'released', 'truncated', 'joined' (queued"
    " behind a step that a newcomer joined, depth 3), 'other work' (the next round was hinted or"
    " beside another in flight), 'failed' (a round failed)",
    ["reason"],
)
ROUND_AHEAD = Counter(
    "specsplit_round_ahead",
    "Verify rounds run on the gateway's draft-ahead hint before they were asked for, by whether "
    "the next round was that round ('used') or not ('dropped')",
    ["outcome"],
)
ROUND_NOT_AHEAD = Counter(
    "specsplit_round_not_ahead",
    "Verify rounds of sequences that send draft-ahead hints after which no round ran ahead, by"
    " reason: 'late' (no hint before the next round started), 'stale' (a hint for another"
    " round), 'unguessed' (the outcome was not among the hint's), 'refused' (checks, context,"
    " free pages), 'busy' (further decode steps, or other work queued on the device), 'off' (the"
    " gateway sent no hint for that round: the overlap gate's draft-ahead rounds without hints)",
    ["reason"],
)
HINTS = Counter(
    "specsplit_hints",
    "Draft-ahead rounds on the gateway by whether their trees went to the verifier as a hint"
    " ('sent') or not: the Verify answered before the drafter ('late'), or the overlap gate ran"
    " the round without hints ('off'; the verifier counts those rounds 'late' too)",
    ["outcome"],
)
DECODED_TOKENS = Counter(
    "specsplit_decoded_tokens",
    "Tokens the verifier decoded in rounds' further decode steps (--decode-steps) and the"
    " drafts of its prompt lookup accepted in them (--decode-lookup): of the generated tokens,"
    " those whose round trip through the gateway another token paid",
)
SESSIONS_OPEN = Gauge("specsplit_sessions_open", "Sessions open on the gateway")
SESSION_KV_PAGES = Gauge(
    "specsplit_session_kv_pages",
    "Verifier KV pages held by sessions between turns (the verifier's count at each turn's end)",
)
SESSION_EVICTIONS = Counter(
    "specsplit_session_evictions",
    "Idle sessions whose KV was freed: 'memory' (KV ran short; the session stays open and "
    "re-prefills on its next turn) or 'expired' (idle past its TTL; the session is gone)",
    ["reason"],
)
SESSION_TOKENS_REUSED = Histogram(
    "specsplit_session_tokens_reused",
    "Per session turn: prompt tokens whose verifier KV was kept from earlier turns",
    buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536),
)


GC_PAUSE_SECONDS = Histogram(
    "specsplit_gc_pause_seconds",
    "One collection of Python's garbage collector (the whole process stops), by generation (2: a"
    " full one, which walks every object the start-up freeze did not set aside)",
    ["generation"],
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)
