#!/usr/bin/env bash
# The GPU suite in one command on a lent GPU machine (after `scripts/gpu_wheels.sh` here; the
# call carries .whl and .gpu):
#   source scripts/gpu_env.sh && scripts/gpu_suite.sh [tests] [engine] [e2e] [smollm2] [e2e2] \
#       [memory] [rpc] [lane] [overlap] [sessions] [profile] [cold] [draft] [gate] [graphs] [rope]
#       [prefill] [small] [ahead] [steps] [eagle] [split] [sampled] [overlap8b] [overlap8b-eagle] [profile8b-eagle]
#       [draft8b-phases] [profile8b-drafter] [critical] [critical8b] [gated8b] [chain8b]
#       [profile8b-verifier] [tests-1] [tests-2] [tests-1a] [tests-1b] [tests-1c] [tests-both]
#       [hinted] [critical8b-eagle] [prefill-chunk] [prefill-chunk-smollm2]
#       [groups-smollm2] [ahead1] [ahead1-ab] [draft-ahead] [probe] [accept-ab] [affinity]
#       [ahead1-pin] [idle-poll] [ahead1-ups] [drift] [knobs1] [chain-auto] [launch-ab]
#       [smollm2-batch] [steps-ab] [tests-par] [ahead-cap]
#       [profile-steps] [smollm2-fixed] [fixed-random] [broadcast] [serving] [serving8b]
#       [tiles] [pdl] [gated] [target-split] [ahead-depth] [profile-depth] [newcomer] [sampled8b]
#       [engine-ab] [engine8b-small] [engine-ahead] [logprobs-cost] [rules-cost] [guide-cost] [rules-ab]
#       [draft-rules-ab] [rules-graphs-ab] [attention-ab] [attention-engine]
#       [verify1-ab] [split-skip] [wide-tile] [wide-split] [graph-memory-ab] [cold-rules]
#       [drafter-warmup] [drafter-warmup-ab] [kernel-builds] [gguf-load] [pointwise-ab] [grounded]
#       [grounded-more] [lookup] [lookup-cost]
# ahead1: issue 9's batch-1 goal as `up` ships it: serial against draft-ahead with misses plain,
# three timed runs of 8 bundled prompts each ($SMOLLM2_GGUF + the shipped head); ahead1-ab:
# ahead1 in this tree, then in .gpu/old (`scripts/gpu_old.sh REV` here, the call carries
# .gpu/old; REV at 85e8c29 or later, which has --prompt-groups), on the same machine (~380 s on
# two H200s); outputs $OUT/ahead1_new.txt and ahead1_old.txt; draft-ahead: the drafter's round
# and its draft-ahead call in process by phase, and their kernels (torch.profiler), batch 1 / 4
# ($DRAFT_BATCHES), then draft-ahead calls as after hits (each catching up an outcome's tokens
# and features), and those calls' host ops (torch.profiler, by self CPU time); sampled chains
# with $DRAFT_TEMPERATURE > 0; probe: each replayed CUDA
# graph's host time a replay and its nodes (bench/graph_probe.py), the drafter's and the
# verifier's at batch 1, then the verifier's launches cProfiled; accept-ab: ahead1 with greedy
# acceptance as the Triton walk and as the torch ops (SPECSPLIT_TRITON_ACCEPT), then the round on
# the device in process, alternating; affinity: `up --cpu-affinity` off / on / on / off
# ($AFFINITY_MODES), batch-1 draft-ahead through the services on random SmolLM2 weights
# (bench/profile_services.py); ahead1-pin: ahead1 pinned and not ($AFFINITY_MODES, default on off);
# idle-poll: the services' loops polling between rounds (--idle-poll-ms 20) or asleep;
# ahead1-ups: ahead1 with each mode's `up` twice, in turn; drift: four `up`s of one setup, the
# GPUs' clocks and the services' threads' cores sampled beside each; knobs1: ahead1's
# ahead-plain with 4 guesses and with --chain-rounds off beside it, every `up` twice in turn
# hinted: bench/hinted_launch.py, the verifier's host work for a round chained on a hint, launched
# on a late hint and launched on its request, 8B shape, batch 1 / 8 / 32, torch.profiler's CPU
# ops, with to_device's staging buffers and without
# tests-par: tests/gpu in three pytest processes at once on one GPU (304 s on an H200, the
# forty-eighth session); tests-1 / tests-2: tests/gpu in two halves, one a call (the whole
# suite took ~700 s on a cold two-H100 machine in the thirty-fourth session, past one call's
# 600 s); tests-1a / tests-1b / tests-1c: tests-1 in three calls (on one cold H100 tests-1 alone
# ran past 600 s in the hundred-and-eleventh session, its second half in the hundred-and-twelfth)
# tests: tests/gpu; engine: bench/gpu_engine.py on the 8B and SmolLM2 shapes; e2e: the whole
# system with an 8B-shaped target and a 1B-shaped draft model (synthetic acceptance); smollm2:
# bench/e2e.py through the three services on SmolLM2-135M-Instruct with the shipped EAGLE-3 head
# (needs the GGUF at $SMOLLM2_GGUF; drafter on cuda:0, verifier on cuda:1 when there are two);
# e2e2: e2e with the drafter on cuda:0 and the verifier on cuda:1; memory: bench/memory.py (8B /
# 1B); rpc: bench/rpc_overhead.py on a random SmolLM2-shaped checkpoint (TCP, then Unix sockets
# with the round lane); lane: bench/e2e.py through the services (random SmolLM2 + the shipped
# head), round lane on and off; overlap:
# bench/overlap.py (every overlap mode and target-only through the services, $SMOLLM2_GGUF + the
# shipped head, batch 1 / 8 / 32); sessions: bench/sessions.py on $SMOLLM2_GGUF; profile:
# bench/profile_services.py (cProfile of the three processes, 32 target-only streams; the GGUF
# or, without $SMOLLM2_GGUF, random SmolLM2-shaped weights); cold: bench/cold_shapes.py (the
# first rounds at new batch sizes after the services' warm-up, random SmolLM2 + the shipped head);
# draft: bench/draft_step.py (a draft round in process, random SmolLM2 + the shipped head); gate:
# the speculation gate through the services (bench/e2e.py and bench/overlap.py with
# --speculation-gate on, $SMOLLM2_GGUF + the shipped head); graphs: bench/graph_launch.py; rope:
# the RoPE + K/V store kernel's GPU tests and the engine step with it and without; prefill: a new
# sequence's first round, graphs (up to 128 tokens) and eager; small: every GPU test with the
# fused small-linear layer path off (SPECSPLIT_SMALL_LINEAR=0), and its A/B; ahead: target-only
# rounds through the services (random SmolLM2) with the verifier's decode steps run ahead and
# without;
# steps: target-only rounds through the services with plain rounds of 1, 2, 4 and 8 decode steps;
# eagle: bench/gpu_e2e.py with an 8B target and an 8B-shaped random EAGLE-3 head; split: a
# round's cost outside the engines (bench/wire_rounds.py, bench/lane_rows.py, and
# bench/profile_services.py unprofiled at batch 1 / 8 / 32 / 64); sampled: the same for sampled
# chains (temperature 1: bench/wire_rounds.py --sampled, bench/gpu_engine.py --sampled-n on
# both shapes; bench/draft_step.py and bench/profile_services.py at batch 1 / 8 / 32, greedy and
# temperature 1); overlap8b: bench/overlap.py through the services with random 8B- and 1B-shaped
# checkpoints (bench/random_model.py) and synthetic acceptance 0.8 / 0.7 / 0.6, serial / groups /
# gated (the drafter on cuda:0, the verifier on the last GPU); overlap8b-eagle: the same with the
# 8B target and a random EAGLE-3 head of its width (bench/random_model.py --eagle3-head);
# profile8b-eagle: that system's round outside the engines (bench/profile_services.py, batch 1 /
# 8 / 32, 128 tokens a stream: each round-lane RPC in stages, and random SmolLM2 + the shipped
# head at batch 1 / 32) and the rows' lane hop (bench/lane_rows.py --echo-process);
# critical: the round's critical path outside the verifier's engine, p50 / p99, serial and
# draft-ahead, $SMOLLM2_GGUF + the shipped head (bench/profile_services.py --overlap);
# critical8b: the same with an 8B-shaped random target and a draft that predicts it
# (bench/random_model.py --mirror-draft; synthetic acceptance), batch 1 / 8 / 32, serial, ahead
# with and without verify ahead, groups; gated8b: the overlap gate's choices on that system
# (bench/overlap.py --modes serial gated); chain8b: draft-ahead on that system with hinted rounds
# chained on the device (--chain-rounds on) and without; profile8b-verifier: that system with
# draft-ahead at batch 32, the services cProfiled;
# profile8b-drafter: that system at batch 1 with the services cProfiled (own and cumulative
# time); draft8b-phases: the 8B head's draft round in process by phase (bench/draft_step.py --phases,
# the rows page-locked as the lane delivers them on a GPU, and pageable); prefill-chunk: long
# prompts among short ones through `up` on the 8B shape, whole against chunked prefills;
# prefill-chunk-smollm2: the same on random SmolLM2 weights (no 8B to build: a shorter call).
# Each part's output goes to stdout and to $OUT/<part>.txt when $OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
export SPECSPLIT_TEST_TOKENIZER="${SPECSPLIT_TEST_TOKENIZER:-$PWD/.gpu/tokenizer}"  # gpu_env.sh sets it
parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=(tests engine e2e)
out=${OUT:-/tmp}
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
devices=(--device cuda:0)  # the verifier's, and the drafter's when there are two GPUs
[[ $gpus -ge 2 ]] && devices=(--device cuda:1 --drafter-device cuda:0)
status=0
run() {  # name, command...
  local name=$1
  shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$out/$name.txt" | grep -v "^\s*$" | tail -40
  [[ ${PIPESTATUS[0]} -eq 0 ]] || { echo "== $name FAILED"; status=1; }
}
in_trees() {  # passes, name, command...: the command run from inside this tree ("new...") and
  # .gpu/old ("old...": `scripts/gpu_old.sh REV`, carried) in the order of `passes` (e.g. "new
  # old"), each tree's code first on the path: `specsplit up` starts the services from the working
  # directory's package (`python -m`: the current directory comes first). $out/<name>_<pass>.txt
  local passes=$1 name=$2 pass dir root=$PWD
  shift 2
  if [[ ! -d .gpu/old ]]; then
    echo "== $name: no .gpu/old here (scripts/gpu_old.sh REV, and carry .gpu/old)"
    status=1
    return
  fi
  cp -r specsplit/v1 specsplit/data .gpu/old/specsplit/  # the stubs gpu_env.sh made, the head
  for pass in $passes; do
    dir=$root
    [[ $pass == old* ]] && dir=$root/.gpu/old
    cd "$dir"
    PYTHONPATH="$dir:/tmp/site" run "${name}_$pass" "$@"
  done
  cd "$root"
}
random_8b_1b() {  # random 8B- and 1B-shaped checkpoints (SmolLM2's vocabulary) at /tmp/llama{8b,1b}
  # and a random EAGLE-3 head for the 8B at /tmp/eagle8b
  [[ -d /tmp/llama8b && -d /tmp/eagle8b ]] || python3 bench/random_model.py /tmp/llama8b \
    --shape llama-8b --eagle3-head /tmp/eagle8b --tokenizer "$SPECSPLIT_TEST_TOKENIZER" \
    --device "cuda:$((gpus - 1))" --dtype bfloat16
  [[ -d /tmp/llama1b ]] || python3 bench/random_model.py /tmp/llama1b --shape llama-1b \
    --tokenizer "$SPECSPLIT_TEST_TOKENIZER" --device cuda:0 --dtype bfloat16
}
mirror_8b() {  # a random 8B-shaped target at /tmp/mirror8b and a draft that predicts it (its
  # first layer, bench/random_model.py --mirror-draft) at /tmp/mirror8b_draft; $MIRROR_LOGIT_SCALE:
  # its logits that many times sharper (sampled rounds whose bonus tokens can be guessed; made
  # once a machine: a later call on it keeps the first call's scale)
  [[ -d /tmp/mirror8b ]] || python3 bench/random_model.py /tmp/mirror8b --shape llama-8b \
    --mirror-draft /tmp/mirror8b_draft --tokenizer "$SPECSPLIT_TEST_TOKENIZER" \
    --device "cuda:$((gpus - 1))" --dtype bfloat16 \
    ${MIRROR_LOGIT_SCALE:+--logit-scale "$MIRROR_LOGIT_SCALE"}
}
random_smollm2() {  # a random-weight SmolLM2-shaped checkpoint at /tmp/smollm2_random
  [[ -d /tmp/smollm2_random ]] ||
    python3 bench/random_model.py /tmp/smollm2_random --tokenizer "$SPECSPLIT_TEST_TOKENIZER"
}
cold_rules() {  # cold's plain rounds under penalties, chains under a repetition penalty, then
  # what the verifier's graphs take (bench/graph_memory.py: the warm-up's seconds and memory)
  run cold_rules python3 bench/cold_shapes.py --model /tmp/smollm2_random --device cuda:0 \
    --temperature 0.7 --top-p 0.95 --presence 0.5 --frequency 0.5 --spec 0 --decode-steps 4 \
    --decode-ahead
  run cold_rules_spec python3 bench/cold_shapes.py --model /tmp/smollm2_random \
    --device cuda:0 --repetition 1.2 --spec 3 --batch 1 2 8
  run graph_memory python3 bench/graph_memory.py --model /tmp/smollm2_random
}
serving() {  # bench/serving.py through `up` ($SERVING_* as the serving part says; $SERVING_DRAFTER:
  # the drafter's flags, $SERVING_EXTRA: a flag added to every setup)
  local setups=() setup
  for setup in ${SERVING_BASE:-default= steps4=--decode-steps=4} ${SERVING_SETUPS:-}; do
    # NAME=FLAG,FLAG: one setup's flags (bench/serving.py splits them as a shell would)
    setups+=(--setup "${setup//,/ }${SERVING_EXTRA:+ $SERVING_EXTRA}")
  done
  # shellcheck disable=SC2086  # $SERVING_DRAFTER and the lists are words
  run serving python3 bench/serving.py --model "${SERVING_MODEL:-/tmp/smollm2_random}" \
    "${devices[@]}" ${SERVING_DRAFTER:---drafter eagle3 --draft-model specsplit/data/eagle3-smollm2} \
    --ignore-eos --max-new-tokens ${SERVING_TOKENS:-128} \
    --num-requests ${SERVING_REQUESTS:-128} --rate ${SERVING_RATES:-20 80 inf} \
    ${SERVING_PROMPT_TOKENS:+--prompt-tokens $SERVING_PROMPT_TOKENS} \
    ${SERVING_LONG_EVERY:+--long-every $SERVING_LONG_EVERY} \
    ${SERVING_TEMPERATURE:+--temperature $SERVING_TEMPERATURE} \
    --spec ${SERVING_SPEC:-target} --ups ${SERVING_UPS:-1} "${setups[@]}" \
    --services-log "$out/serving_services.log"  # the gates' choices with their rates
}
for part in "${parts[@]}"; do
  case $part in
    tests) run tests python3 -m pytest -q -p no:cacheprovider --durations=15 tests/gpu ;;
    hinted)
      run hinted_launch python3 bench/hinted_launch.py --shape llama-8b \
        --device "cuda:$((gpus - 1))" --batch 1 8 32 --staging on off --profile torch ;;
    tests-both)  # the two halves at once: tests-1 alone on the last GPU, tests-2 beside it
      # (its two-GPU cases need both); one after the other they took 334 + 349 s on two H100s
      # (thirty-sixth session). tests-1's output: $OUT/tests-1.txt
      CUDA_VISIBLE_DEVICES=$((gpus > 0 ? gpus - 1 : 0)) OUT="$out" bash "$0" tests-1 \
        >"$out/tests-1.log" 2>&1 &
      first=$!
      OUT="$out" bash "$0" tests-2 || status=1
      wait "$first" || { echo "== tests-1 FAILED"; status=1; }
      echo "== tests-1 (beside it):"
      grep -v "^\s*$" "$out/tests-1.log" | tail -5 ;;
    tests-par)  # tests/gpu in $TEST_JOBS (default 3) pytest processes at once on the one GPU,
      # the files dealt by their measured time (scripts/deal_tests.py, tests/gpu/durations.txt:
      # longest first, each to the process with the least so far) so that the processes end
      # together (one call on a one-GPU machine; the two-GPU cases skip there); each process's
      # output with every test's duration: $OUT/tests-par-<n>.txt (`python3
      # scripts/deal_tests.py --update tests/gpu/durations.txt <them>` rewrites the table);
      # $TEST_FILES: those files alone (space-separated), e.g. a change's GPU tests before a
      # benchmark in the same call (`TEST_FILES="tests/gpu/a.py tests/gpu/b.py" TEST_JOBS=2
      # scripts/gpu_suite.sh tests-par serving`)
      jobs=${TEST_JOBS:-3}
      read -ra files <<<"${TEST_FILES:-$(echo tests/gpu/test_*.py)}"
      mapfile -t dealt < <(python3 scripts/deal_tests.py --jobs "$jobs" "${files[@]}")
      pids=()
      for ((j = 0; j < jobs; j++)); do
        read -ra mine <<<"${dealt[$j]:-}"
        if ((${#mine[@]} == 0)); then  # more processes than files (pytest alone runs tests/)
          : >"$out/tests-par-$j.txt"
          true &
          pids+=($!)
          continue
        fi
        # a test past $TEST_DUMP_S seconds dumps every thread's stack into its output, and
        # warnings are logged live, each under its test's name (one hang in the sixty-sixth
        # session's first call: tests/gpu/test_sessions_gpu.py[eagle3], past 350 s, where it
        # takes 9 s; not seen again in two runs; a round failing over and over would log)
        python3 -m pytest -q -p no:cacheprovider --durations=0 \
          -o faulthandler_timeout="${TEST_DUMP_S:-240}" -o log_cli=true \
          --log-cli-level=WARNING "${mine[@]}" \
          >"$out/tests-par-$j.txt" 2>&1 &
        pids+=($!)
      done
      for ((j = 0; j < jobs; j++)); do
        wait "${pids[$j]}" || { echo "== tests-par-$j FAILED"; status=1; }
        echo "== tests-par-$j:"
        grep -v "^\s*$" "$out/tests-par-$j.txt" | tail -4
      done ;;
    ahead-cap)  # target-only rounds at batch 32 through the services (random SmolLM2): `up`'s
      # defaults before the forty-ninth session (rounds of 4 decode steps, --decode-ahead-max-batch
      # 16: the step after a round's last not run ahead), then that step run ahead (cap 64, the
      # default since) with rounds of 4, 8 and 16 steps
      # and with rounds grown from 4 as measured (--decode-steps-adaptive, "a"); five runs of
      # 512 tokens a stream each per `up` (the forty-eighth session's single runs of 256 spread
      # 13.1-18.1k tok/s for one setup). One `up` a setup takes ~55 s on an H200, so a call runs
      # the setups once (~5 min): run the part in two calls (CAP_PASS=1, then 2) for each setup's
      # second `up`. Output: $OUT/cap<cap>_steps<steps>_<pass>.txt, five files ($CAP_SETUPS:
      # others, STEPS:CAP each, e.g. "a:16 a:64")
      random_smollm2
      for setup in ${CAP_SETUPS:-4:16 4:64 8:64 16:64 a:64}; do
        IFS=: read -r steps cap <<<"$setup"
        if [[ -z $steps || -z $cap ]]; then
          echo "== ahead-cap: bad setup $setup (want STEPS:CAP)"
          status=1
          continue
        fi
        rounds=(--up-arg=--decode-steps=$steps)
        [[ $steps == a ]] && rounds=(--up-arg=--decode-steps=4 --up-arg=--decode-steps-adaptive)
        run "cap${cap}_steps${steps}_${CAP_PASS:-1}" python3 bench/profile_services.py \
          --model /tmp/smollm2_random "${devices[@]}" --drafter eagle3 \
          --draft-model specsplit/data/eagle3-smollm2 --batch 32 --max-new-tokens 512 \
          --repeat 5 --top 0 --target-only "${rounds[@]}" --up-arg=--decode-ahead-max-batch=$cap
      done ;;
    profile-steps)  # the services cProfiled at batch 32, target-only rounds of 4 decode steps
      # (fixed) with the step after a round's last run ahead (where the verifier's host time a
      # step goes)
      random_smollm2
      run profile_steps python3 bench/profile_services.py --model /tmp/smollm2_random \
        "${devices[@]}" --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --batch 32 \
        --max-new-tokens 512 --top 45 --sort tottime cumulative --target-only \
        --up-arg=--decode-steps=4 --up-arg=--decode-ahead-max-batch=64 ;;
    tests-1|tests-2)  # the files up to test_paged_attention_gpu.py, and the rest (at once on
      # two GPUs: tests-both)
      mapfile -t half < <(printf '%s\n' tests/gpu/test_*.py | LC_ALL=C awk -v part="$part" \
        '(part == "tests-1") == ($0 <= "tests/gpu/test_paged_attention_gpu.py")')
      run "$part" python3 -m pytest -q -p no:cacheprovider --durations=15 "${half[@]}" ;;
    tests-1a|tests-1b|tests-1c)  # tests-1 in three calls: the files up to
      # test_decode_ahead_gpu.py, then up to test_gguf_dequant_gpu.py, then the rest of tests-1
      # (tests-1 alone ran past one 600 s call on a cold H100 in the hundred-and-eleventh
      # session: 177 of its 322 tests; in the hundred-and-twelfth tests-1a took 357 s and the
      # rest, then tests-1b, ran past 600 s after 77 tests)
      mapfile -t half < <(printf '%s\n' tests/gpu/test_*.py | LC_ALL=C awk -v part="$part" \
        '$0 <= "tests/gpu/test_paged_attention_gpu.py" &&
         (part == "tests-1a") == ($0 <= "tests/gpu/test_decode_ahead_gpu.py") &&
         (part == "tests-1c") == ($0 > "tests/gpu/test_gguf_dequant_gpu.py")')
      run "$part" python3 -m pytest -q -p no:cacheprovider --durations=15 "${half[@]}" ;;
    engine)
      run engine_8b python3 bench/gpu_engine.py --shape llama-8b --batch 1 8 32 64 \
        --verify-n 4 8 16 32 64 --verify-batch 1 8 32 --steps 20 --compile-batch 1
      run engine_smollm2 python3 bench/gpu_engine.py --shape smollm2-135m --batch 1 8 32 \
        --verify-n 8 --verify-batch 1 --steps 50 --compile-batch 1 ;;
    engine-ahead)  # issue 8's engine goals as a GPU verifier runs by default: the next decode
      # step run ahead, rounds of 1 and of 4 steps, HF beside (~210 s on an H200; the
      # seventy-sixth session's 8B batch 1: 4.611 ms, 0.86 of the floor)
      run engine_8b_ahead python3 bench/gpu_engine.py --shape llama-8b --batch 1 32 --verify-n 8 \
        --verify-batch 1 --steps 30 --decode-steps 4 --decode-ahead --compile-batch 1
      run engine_smollm2_ahead python3 bench/gpu_engine.py --shape smollm2-135m --batch 1 8 32 \
        --verify-n 8 --verify-batch 1 --steps 50 --decode-steps 4 --decode-ahead --compile-batch 1 ;;
    logprobs-cost)  # what asking for log-probabilities (and 5 most likely tokens) costs a
      # round in process, decode steps run ahead: each shape without, then with (no HF)
      for shape in smollm2-135m llama-8b; do
        for ask in -1 5; do
          run "logprobs_${shape}_$ask" python3 bench/gpu_engine.py --shape "$shape" --batch 1 32 \
            --verify-n 8 --verify-batch 1 32 --steps 30 --decode-steps 4 --decode-ahead --no-hf \
            --sampled-n 8 --logprobs "$ask"
        done
      done ;;
    rules-cost)  # what logit rules (a bias and the three penalties over a 256-token output and
      # the prompt: bench/gpu_engine.py --rules) cost a round in process, decode steps run ahead
      # where a round allows it (not with rules): each shape without, then with (no HF)
      for shape in smollm2-135m llama-8b; do
        for rules in "" --rules; do
          run "rules_${shape}${rules}" python3 bench/gpu_engine.py --shape "$shape" --batch 1 32 \
            --verify-n 8 --verify-batch 1 32 --steps 30 --decode-steps 4 --decode-ahead --no-hf \
            --sampled-n 8 $rules
        done
      done ;;
    guide-cost)  # what a guide's masks (one of its own a row, half the vocabulary allowed:
      # bench/gpu_engine.py --guide) cost a round in process, each shape without, then with
      for shape in smollm2-135m llama-8b; do
        for guide in "" --guide; do
          run "guide_${shape}${guide}" python3 bench/gpu_engine.py --shape "$shape" --batch 1 32 \
            --verify-n 8 --verify-batch 1 32 --steps 30 --decode-ahead --no-hf --sampled-n 8 $guide
        done
      done ;;
    rules-ab)  # a rules round's and a guided round's time in this tree and in .gpu/old
      # (`scripts/gpu_old.sh REV`, then `cp bench/gpu_engine.py .gpu/old/bench/`: both trees
      # timed by one bench, whose rules are new objects each round, as the wire's), SmolLM2
      # shape, CUDA graphs, in process, on one machine, the trees in turn twice:
      # $out/rulesab_<mode>_{new,old}{,2}.txt; $RULES_AB_MODES: these modes alone
      for mode in ${RULES_AB_MODES:---rules --guide}; do
        in_trees "new old new2 old2" "rulesab_${mode#--}" python3 bench/gpu_engine.py \
          --shape smollm2-135m --batch 1 32 --verify-n 8 --verify-batch 1 32 --steps 60 \
          --decode-ahead --no-hf --no-eager --sampled-n 8 "$mode"
      done ;;
    rules-graphs-ab)  # a decode step's and a chain-of-3 round's wall time under logit rules with
      # the rules graphs (verifier/rules_graphs.py) and without, alternating three times in one
      # process (bench/profile_step.py --rules-graphs-ab; batch 32 with fewer steps: the bench's
      # KV pool), then the host's share of a rules round each way (bench/rules_graphs.py)
      run rulesgraphs_ab python3 bench/profile_step.py --shape smollm2-135m --batch 1 8 --n 0 3 \
        --decode-ahead --steps 60 --rules --rules-graphs-ab
      run rulesgraphs_ab32 python3 bench/profile_step.py --shape smollm2-135m --batch 32 --n 0 \
        --decode-ahead --steps 15 --rules --rules-graphs-ab
      run rulesgraphs_host python3 bench/rules_graphs.py --batch 1 8 32 ;;
    draft-rules-ab)  # the drafter's Draft with and without logit rules (bench/draft_step.py
      # --rules, random SmolLM2-shaped target and head, greedy chain of 3, batch 1 / 8 / 32) in
      # this tree and in .gpu/old (`scripts/gpu_old.sh REV`), in turn twice:
      # $out/draftrules_{new,old}{,2}.txt
      in_trees "new old new2 old2" draftrules python3 bench/draft_step.py \
        --random-target smollm2-135m --batch 1 8 32 --shape 3x1x3 --rules --rounds 300 ;;
    engine8b-small)  # an 8B's decode step at batch $SMALL8B_BATCHES (default 1 4) through the
      # small-linear broadcast path's fused kernels (with PDL; the weights' L2 prefetch of whole
      # rows, of each row's first 8 lines, or none) against the default unfused layer (cuBLAS;
      # llama.SMALL_LINEAR_MAX_WEIGHT_BYTES keeps the small path to SmolLM2-sized layers),
      # alternating in one process (bench/step_ab.py); the small path's first compile at an
      # 8B's K takes ~200 s, so one batch with two variants fits a call. The seventy-sixth
      # session's H200 at batch 1: small 8.747 ms a step, base 4.583 (1.91x slower)
      run step_ab_8b python3 bench/step_ab.py --shape llama-8b --batch ${SMALL8B_BATCHES:-1 4} \
        --variant base= --variant small=max_weight_mb=1024 \
        --variant small-pf8=max_weight_mb=1024,prefetch_lines=8 \
        --variant small-nopf=max_weight_mb=1024,prefetch=0 --reps ${SMALL8B_REPS:-5} --steps 10 \
        --decode-steps 4 ;;
    e2e)
      run e2e_8b_1b python3 bench/gpu_e2e.py --target llama-8b --draft llama-1b \
        --rates 0.8 0.7 0.6 --spec 3 --batch 1 8 32 ;;
    smollm2)
      run e2e_smollm2 python3 bench/e2e.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --max-new-tokens 128 \
        --num-prompts 8 --spec 3 5 --assistant-layers 0 ;;
    smollm2-batch)  # the same at batch 8 and 32 (8 streams at once, and the 8 prompts cycled to
      # 32), HF generate on one left-padded batch each, plain and static cache + compile
      run e2e_smollm2_batch python3 bench/e2e.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --max-new-tokens 128 \
        --num-prompts 8 --spec 3 --assistant-layers 0 --batch 8 32 ;;
    smollm2-fixed)  # issue 8's batch comparison at a fixed length: every stream, specsplit's
      # and HF's, runs $FIXED_TOKENS (default 256) tokens past EOS (--ignore-eos), batch
      # $FIXED_BATCHES (default 32: HF's compiles took ~250 s a batch size); target-only and a
      # chain of 3 against HF's batch; $FIXED_UP_ARGS: more bench/e2e.py arguments (e.g.
      # "--up-arg=--decode-steps=4"). Runs of 256 tokens (0.3-0.5 s) swung 1.8x-3.1x HF at batch
      # 8 between two calls (fifty-second session): longer ones settle a ratio
      run e2e_smollm2_fixed python3 bench/e2e.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
        --max-new-tokens ${FIXED_TOKENS:-256} \
        --num-prompts 8 --spec 3 --assistant-layers 0 --ignore-eos \
        --batch ${FIXED_BATCHES:-32} ${FIXED_UP_ARGS:-} ;;
    grounded)  # prompt lookup where answers copy the prompt (bench/data/grounded_prompts.jsonl)
      # and on the chat prompts: `up` on $SMOLLM2_GGUF with --drafter ngram, the gate on (the
      # default-shape row) and chains of 3 / 5 asked per request, against target-only, HF
      # generate, its prompt lookup and static cache + compile
      run e2e_grounded python3 bench/e2e.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter ngram --prompts grounded --num-prompts 8 --max-new-tokens 128 --spec 3 5 \
        --speculation-gate on --assistant-layers 0 ;;
    lookup)  # --decode-lookup (prompt lookup in the verifier's decode steps) through `up` on
      # $SMOLLM2_GGUF: the edits and the chat prompts, each `up` with --decode-lookup in
      # $LOOKUP_VALUES (default "3 0"), target-only and the gated default rows; HF generate, its
      # prompt lookup and static cache + compile beside the first on the edits
      first=1
      for set in grounded chat; do
        for value in ${LOOKUP_VALUES:-3 0}; do
          hf=(--no-hf)
          [[ $first == 1 && $set == grounded ]] && hf=(--assistant-layers 0)
          first=0
          run "e2e_lookup_${set}_$value" python3 bench/e2e.py --model "$SMOLLM2_GGUF" \
            "${devices[@]}" --drafter ngram --prompts $set --num-prompts 16 \
            --max-new-tokens 128 --speculation-gate on --up-arg=--decode-lookup=$value "${hf[@]}"
        done
      done ;;
    lookup-cost)  # what a lookup step costs against a plain one, random weights in process
      # (bench/step_ab.py, batch 1, SmolLM2 and 8B shapes): decode steps in rounds of 4 (the
      # next run ahead) and of 1, and verify rounds of 1 + 3 (a chain's step, nothing ahead)
      for shape in smollm2-135m llama-8b; do
        for what in "--decode-steps 4" "--decode-steps 1" "--verify-n 3"; do
          run "lookup_cost_${shape}_${what// /_}" python3 bench/step_ab.py --shape $shape \
            --batch 1 --variant base= --reps 7 --steps 20 $what
        done
      done ;;
    grounded-more)  # grounded's other two runs (each `up` starts afresh): the chat prompts
      # with prompt lookup, then the shipped head on the edits
      run e2e_grounded_chat python3 bench/e2e.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter ngram --prompts chat --num-prompts 16 --max-new-tokens 128 --spec 3 \
        --speculation-gate on --no-hf
      run e2e_grounded_head python3 bench/e2e.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --prompts grounded \
        --num-prompts 8 --max-new-tokens 128 --spec 3 --no-hf ;;
    gated)  # what `up`'s default on a GPU streams: the speculation gate on (the default-shape
      # row gated) against target-only requests through the same `up`, no HF rows (smollm2-fixed
      # has them), $FIXED_TOKENS (default 1024) tokens a stream past EOS, batch $FIXED_BATCHES
      # (default "1 8 32"), $GATED_PASSES passes (default 1), the gate's rounds by kind;
      # $SMOLLM2_GGUF + the shipped head; the gate's choices in $OUT/e2e_gated_services.log
      run e2e_gated python3 bench/e2e.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
        --max-new-tokens ${FIXED_TOKENS:-1024} --num-prompts 8 --spec --assistant-layers 0 \
        --ignore-eos --no-hf --speculation-gate on --passes ${GATED_PASSES:-1} \
        --services-log "$out/e2e_gated_services.log" --batch ${FIXED_BATCHES:-1 8 32} ;;
    fixed-random)  # smollm2-fixed's comparison on random SmolLM2-shaped weights (the speed
      # only, no GGUF needed; every stream runs $FIXED_TOKENS tokens): `up`'s defaults
      # ($FIXED_UP_ARGS: more) against HF's batch, batch $FIXED_BATCHES (default 32)
      random_smollm2
      run e2e_random_fixed python3 bench/e2e.py --model /tmp/smollm2_random "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
        --max-new-tokens ${FIXED_TOKENS:-256} \
        --num-prompts 8 --spec 3 --assistant-layers 0 --ignore-eos \
        --batch ${FIXED_BATCHES:-32} ${FIXED_UP_ARGS:-} ;;
    eagle)  # an 8B target with a random EAGLE-3 head of its width (synthetic acceptance), in
      # one process: serial and groups vs the target alone (4-step rounds run ahead); the
      # head on cuda:0 and the target on cuda:1 when there are two GPUs
      run e2e_8b_eagle python3 bench/gpu_e2e.py --target llama-8b --drafter eagle3 \
        --rates 0.8 0.7 0.6 --spec 3 5 --batch 1 8 32 --modes serial groups groups-early \
        "${devices[@]}" ;;
    e2e2)  # the 8B / 1B system with the drafter and the verifier on two GPUs
      run e2e_8b_1b_2gpu python3 bench/gpu_e2e.py --target llama-8b --draft llama-1b \
        --rates 0.8 0.7 0.6 --spec 3 --batch 1 8 32 --modes serial groups groups-early \
        --device cuda:1 --drafter-device cuda:0 ;;
    memory)
      run memory python3 bench/memory.py --target llama-8b --draft llama-1b "${devices[@]}" \
        --context 2048 --batch 8 32 64 ;;
    rpc)
      random_smollm2
      run rpc python3 bench/rpc_overhead.py --model /tmp/smollm2_random --device cuda:0 \
        --rounds 1000
      run rpc_unix python3 bench/rpc_overhead.py --model /tmp/smollm2_random --device cuda:0 \
        --rounds 1000 --transport unix ;;
    lane)  # target-only and EAGLE chain 3 rounds through the services, round lane on and off
      random_smollm2
      for lane in on off; do
        run "lane_$lane" python3 bench/e2e.py --model /tmp/smollm2_random "${devices[@]}" \
          --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --max-new-tokens 128 \
          --num-prompts 4 --spec 3 --no-hf --round-lane "$lane"
      done ;;
    ahead)  # target-only rounds through the services, the verifier's decode steps ahead on / off
      random_smollm2
      for ahead in on off; do
        run "ahead_$ahead" python3 bench/e2e.py --model /tmp/smollm2_random "${devices[@]}" \
          --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --max-new-tokens 128 \
          --num-prompts 4 --no-hf --decode-ahead "$ahead"
      done ;;
    steps)  # rounds of several decode steps: in process (per token, decode ahead on), then
      # target-only rounds through the services (random SmolLM2): plain rounds of 1, 4, 2 and
      # 8 decode steps, one stream (e2e), then 1 / 8 / 16 streams (overlap, steps 1 and 4)
      run engine_steps python3 bench/gpu_engine.py --shape smollm2-135m --batch 1 8 32 \
        --verify-n --verify-batch --steps 100 --no-hf --decode-ahead --decode-steps 4
      random_smollm2
      for steps in 1 4 2 8; do
        run "steps_$steps" python3 bench/e2e.py --model /tmp/smollm2_random "${devices[@]}" \
          --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --max-new-tokens 128 \
          --num-prompts 4 --no-hf --decode-steps "$steps"
      done
      for steps in 1 4; do
        run "steps_overlap_$steps" python3 bench/overlap.py --model /tmp/smollm2_random \
          "${devices[@]}" --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
          --batch 1 8 16 --max-new-tokens 128 --modes serial --decode-steps "$steps"
      done ;;
    overlap8b)  # the 8B / 1B system through the services, synthetic acceptance (timing only)
      random_8b_1b
      run overlap_8b_1b python3 bench/overlap.py --model /tmp/llama8b "${devices[@]}" \
        --drafter model --draft-model /tmp/llama1b --batch 1 8 32 --max-new-tokens 128 --spec 3 \
        --modes serial groups gated --synthetic-acceptance 0.8,0.7,0.6 ;;
    overlap8b-eagle)  # the 8B target with a random EAGLE-3 head of its width through the
      # services (synthetic acceptance: timing only), as an 8B would be served
      random_8b_1b
      run overlap_8b_eagle python3 bench/overlap.py --model /tmp/llama8b "${devices[@]}" \
        --drafter eagle3 --draft-model /tmp/eagle8b --batch 1 8 32 --max-new-tokens 128 \
        --spec 3 --modes serial groups gated --synthetic-acceptance 0.8,0.7,0.6 ;;
    profile8b-eagle)  # where a round goes outside the engines with the 8B target and its head
      # through the services (serial rounds, synthetic acceptance), and the host's socket
      # buffer caps (the round lane asks for 8 MB)
      random_8b_1b
      cat /proc/sys/net/core/wmem_max /proc/sys/net/core/rmem_max | paste -sd' ' |
        sed 's/^/net.core.wmem_max rmem_max: /'
      # the rows' hops cost more inside the services than alone: NUMA nodes apart?
      lscpu | grep -iE "^(model name|socket|numa)" ; nvidia-smi topo -m 2>/dev/null | head -8
      run profile_8b_eagle python3 bench/profile_services.py --model /tmp/llama8b \
        "${devices[@]}" --drafter eagle3 --draft-model /tmp/eagle8b --batch 1 8 32 \
        --max-new-tokens 128 --top 0 --synthetic-acceptance 0.8,0.7,0.6
      random_smollm2
      run profile_smollm2_stages python3 bench/profile_services.py --model /tmp/smollm2_random \
        "${devices[@]}" --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
        --batch 1 32 --max-new-tokens 128 --top 0
      run lane_rows python3 bench/lane_rows.py --width 12288 1728 --mode beside --echo-process ;;
    profile8b-drafter)  # the same system at batch 1, each service's main thread cProfiled (by
      # own and by cumulative time): why a Draft's engine call takes longer there than in process
      random_8b_1b
      run profile_8b_drafter python3 bench/profile_services.py --model /tmp/llama8b \
        "${devices[@]}" --drafter eagle3 --draft-model /tmp/eagle8b --batch 1 \
        --max-new-tokens 128 --top 45 --sort tottime cumulative \
        --synthetic-acceptance 0.8,0.7,0.6 ;;
    critical)  # the round's critical path outside the verifier's engine (p50 / p99), serial
      # rounds and draft-ahead, with real acceptance ($SMOLLM2_GGUF + the shipped head)
      for mode in serial ahead; do
        run "critical_$mode" python3 bench/profile_services.py --model "$SMOLLM2_GGUF" \
          "${devices[@]}" --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
          --batch 1 8 --max-new-tokens 128 --top 0 --overlap "$mode"
      done ;;
    critical8b)  # the same with an 8B-shaped target whose draft predicts it (random weights,
      # bench/random_model.py --mirror-draft: its first layer; synthetic acceptance 0.8 / 0.7 /
      # 0.6, timing only), so that draft-ahead's guesses hit at an 8B target's verify time
      mirror_8b
      # ahead-unhinted: --verify-ahead off; groups-early: groups with --early-verify;
      # ahead-g1: one bonus guess per accept length (--ahead-guesses 1: the draft's top token,
      # which the synthetic acceptance's rejections rule out, so ~1/3 of outcomes are guessed
      # and the rest run plain, placed plain on the device when chained), ahead-g1-unchained:
      # the same with --chain-rounds off; $CRITICAL_MODES: fewer or others (the call's 10
      # minutes); $CRITICAL_BATCH: other batch sizes
      for mode in ${CRITICAL_MODES:-serial ahead ahead-unhinted groups}; do
        hint=on && [[ $mode == ahead-unhinted ]] && hint=off
        early=off && [[ $mode == groups-early ]] && early=on
        more=()
        [[ $mode == ahead-g1* ]] && more+=(--up-arg=--ahead-guesses=1)
        [[ $mode == *-unchained ]] && more+=(--chain-rounds off)
        overlap=${mode%%-*}
        run "critical8b_$mode" python3 bench/profile_services.py --model /tmp/mirror8b \
          "${devices[@]}" --drafter model --draft-model /tmp/mirror8b_draft \
          --batch ${CRITICAL_BATCH:-1 8 32} --max-new-tokens 128 --top 0 --overlap "$overlap" \
          --verify-ahead "$hint" --early-verify "$early" --synthetic-acceptance 0.8,0.7,0.6 \
          "${more[@]}" --services-log "$out/critical8b_services.log"
      done ;;
    critical8b-eagle)  # draft-ahead at batch 1 ($CRITICAL_BATCH: others) with the 8B target and
      # a random EAGLE-3 head of its width (synthetic acceptance: timing only), hinted rounds
      # chained (hidden-state rounds chain since the thirty-fifth session) and not: the random
      # head's bonus guesses miss, so nearly every outcome runs plain, chained ones placed plain
      random_8b_1b
      for chain in on off; do
        run "critical8b_eagle_chain_$chain" python3 bench/profile_services.py \
          --model /tmp/llama8b "${devices[@]}" --drafter eagle3 --draft-model /tmp/eagle8b \
          --batch ${CRITICAL_BATCH:-1} --max-new-tokens 128 --top 0 --overlap ahead \
          --verify-ahead on --chain-rounds "$chain" --synthetic-acceptance 0.8,0.7,0.6
      done ;;
    chain8b)  # draft-ahead with verify ahead on the critical8b system, hinted rounds chained on
      # the device behind the round in flight (--chain-rounds on, every batch size:
      # --chain-max-batch 64) and launched after the answer (off), batch 1 / 8
      # ($CHAIN_BATCH, $CHAIN_MODES: others)
      mirror_8b
      for chain in ${CHAIN_MODES:-on off}; do
        run "chain8b_$chain" python3 bench/profile_services.py --model /tmp/mirror8b \
          "${devices[@]}" --drafter model --draft-model /tmp/mirror8b_draft \
          --batch ${CHAIN_BATCH:-1 8} --max-new-tokens 128 --top 0 --overlap ahead \
          --verify-ahead on --chain-rounds "$chain" --chain-max-batch 64 \
          --synthetic-acceptance 0.8,0.7,0.6
      done ;;
    profile8b-verifier)  # the critical8b system with draft-ahead at batch 32 ($PROFILE_BATCH:
      # others), each service's main thread cProfiled: where the verifier's ~3 ms of host work
      # launching a round goes there on two H100s, and the gateway's
      mirror_8b
      run profile8b_verifier python3 bench/profile_services.py --model /tmp/mirror8b \
        "${devices[@]}" --drafter model --draft-model /tmp/mirror8b_draft \
        --batch ${PROFILE_BATCH:-32} --max-new-tokens 128 --top 45 --sort tottime cumulative \
        --overlap ahead --verify-ahead on --synthetic-acceptance 0.8,0.7,0.6 ;;
    gated8b)  # the overlap gate's choices on the critical8b system (serial, and draft-ahead
      # on its own, in the same run): it explores groups, draft-ahead with and without the
      # hint, and serial rounds per batch size during the warm-up, then runs its choice
      # ($GATED_MODES, $GATED_BATCH: others, e.g. "serial ahead gated", "8 32"; $GATED_CHAIN:
      # the verifier's --chain-rounds)
      mirror_8b
      run gated8b python3 bench/overlap.py --model /tmp/mirror8b "${devices[@]}" \
        --drafter model --draft-model /tmp/mirror8b_draft --batch ${GATED_BATCH:-1 8 32} \
        --max-new-tokens 128 --modes ${GATED_MODES:-serial gated} \
        ${GATED_CHAIN:+--chain-rounds "$GATED_CHAIN"} --synthetic-acceptance 0.8,0.7,0.6 \
        --services-log "$out/gated8b_services.log"
      # the gates' measurements behind each choice (the forty-ninth session's chose serial at
      # batch 1 where draft-ahead ran 1.56x serial in the same run)
      grep -E "overlap gate|speculation gate" "$out/gated8b_services.log" | tail -20 ;;
    draft8b-phases)  # the 8B head's draft round in process, by phase
      run draft8b_phases python3 bench/draft_step.py --random-target llama-8b --batch 1 8 32 \
        --shape 3x1x3 --rounds 200 --phases --rows pinned pageable ;;
    groups-smollm2)  # groups with the early Verify and without it, SmolLM2 + the shipped head
      # ($SMOLLM2_GGUF, real acceptance; without it random SmolLM2-shaped weights with SYNTHETIC
      # ACCEPTANCE 0.5 / 0.4 / 0.3, about the head's real accepted length: timing only), batch
      # 8 / 32: the round outside the verifier's device and each engine's call, to find why the
      # early Verify ran 0.65x / 0.73x groups there (thirty-sixth session) where the 8B-shaped
      # system gained 1.25x / 1.38x; then groups with it cProfiled at batch 8 (where a group's
      # round trip goes outside the engines; bench/groups_model.py: two groups are busy at most
      # 2V / (V + D + 4R))
      local_model=("${SMOLLM2_GGUF:-}")
      if [[ -z ${SMOLLM2_GGUF:-} ]]; then
        random_smollm2
        local_model=(/tmp/smollm2_random --synthetic-acceptance 0.5,0.4,0.3)
      fi
      for early in off on; do
        run "groups_smollm2_early_$early" python3 bench/profile_services.py \
          --model "${local_model[@]}" "${devices[@]}" --drafter eagle3 \
          --draft-model specsplit/data/eagle3-smollm2 --batch 8 32 --max-new-tokens 128 \
          --top 0 --overlap groups --early-verify "$early"
      done
      run groups_smollm2_profiled python3 bench/profile_services.py --model "${local_model[@]}" \
        "${devices[@]}" --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
        --batch 8 --max-new-tokens 128 --top 40 --sort tottime cumulative --overlap groups \
        --early-verify "${PROFILED_EARLY:-on}" ;;
    overlap)  # $OVERLAP_MODES, $OVERLAP_TOKENS, $OVERLAP_REPEAT (timed runs each): others (64
      # tokens a stream gave ~+-25% between `up` starts in the thirty-sixth session; four modes
      # at 64 tokens took 283 s). "ahead" drafts its misses; "ahead-plain" is `up`'s default
      run overlap python3 bench/overlap.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --batch 1 8 32 \
        --max-new-tokens "${OVERLAP_TOKENS:-128}" --repeat "${OVERLAP_REPEAT:-1}" \
        --modes ${OVERLAP_MODES:-serial groups groups-early ahead ahead-plain gated} ;;
    ahead1)  # ~170 s on two H100s; each timed run streams 8 prompts one after another (runs
      # of one 128-token stream scattered by +-30%, thirty-ninth session)
      run ahead1 python3 bench/overlap.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --batch 1 \
        --max-new-tokens 128 --repeat 3 --prompt-groups 8 --modes serial ahead-plain ;;
    ahead1-ab)
      in_trees "new old" ahead1 python3 bench/overlap.py --model "$SMOLLM2_GGUF" \
        "${devices[@]}" --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --batch 1 \
        --max-new-tokens 128 --repeat 3 --prompt-groups 8 --modes serial ahead-plain ;;
    launch-ab)  # the verifier's launch by phase (bench/hinted_launch.py --phases, SmolLM2 shape,
      # hidden states, batch 1 / 8), this tree and .gpu/old (`scripts/gpu_old.sh REV`, carried)
      # in turn, twice: the bench script of this tree, the code of each
      [[ -d .gpu/old ]] && cp -r specsplit/v1 .gpu/old/specsplit/
      for pass in new1 old1 new2 old2; do
        tree=${pass%?}
        [[ $tree == old && ! -d .gpu/old ]] && continue
        dir=$PWD
        [[ $tree == old ]] && dir=$PWD/.gpu/old
        PYTHONPATH="$dir:/tmp/site" run "launch_$pass" python3 bench/hinted_launch.py \
          --shape smollm2-135m --device cuda:0 --modes plain after --hidden-states \
          --no-synthetic --rounds 80 --batch 1 8 --phases
      done ;;
    attention-ab)  # paged attention's single pass at batch 8-64 (the 8B's 24-51 us a layer at
      # batch 32, 512 tokens: ~1/3 of its K/V's bandwidth, eighty-eighth session): key tiles,
      # stages and page ids a tile ahead (bench/attention_kernel.py --sweep), decode and a
      # causal / tree-masked 1 + 8, then the 8B's step at batch 32 with the page ids ahead or
      # not (bench/step_ab.py, alternating in one process; $ATTN_STEP_CONTEXTS, default "512
      # 4096"; "" skips it: the sweeps alone take ~3 min)
      run attention_decode python3 bench/attention_kernel.py --batches ${ATTN_BATCHES:-8 32 64} \
        --kv-lens 512 4096 --sweep --no-ref
      for tree in "" --tree; do
        run "attention_verify${tree:+_tree}" python3 bench/attention_kernel.py --batches 32 \
          --kv-lens 512 4096 --q-len 9 $tree --sweep --no-ref
      done
      for context in ${ATTN_STEP_CONTEXTS-512 4096}; do  # (~2 min each: two 8B engines)
        run "attention_step_ab_$context" python3 bench/step_ab.py --shape llama-8b \
          --batch 32 --context $context --variant base= --variant ahead=pages_ahead=1 --reps 3
      done ;;
    verify1-ab)  # issue 8's verify cost at batch 1 (1 + 8 against one token, 8B shape; the
      # goal <= 1.15x read 1.12x at 63120f7 and 1.21x at 95d4638 at 512 tokens, on two machines):
      # this tree and .gpu/old (`scripts/gpu_old.sh REV`, carried) in turn, $AB_PASSES (default
      # "new1 old1 new2 old2"), at $VERIFY1_CONTEXTS (default "512 4096"), then each tree's
      # kernels at 512 tokens (bench/profile_step.py, torch.profiler)
      passes=${AB_PASSES:-new1 old1 new2 old2}
      for context in ${VERIFY1_CONTEXTS:-512 4096}; do
        in_trees "$passes" "verify1_$context" python3 bench/gpu_engine.py --shape llama-8b \
          --batch 1 --verify-n 8 --verify-batch 1 --context "$context" --steps 30 \
          --decode-ahead --no-hf --no-eager
      done
      in_trees "new old" verify1_profile python3 bench/profile_step.py --shape llama-8b \
        --batch 1 --n 0 8 --context 512 --steps 10 ;;
    split-skip)  # SKIP_EMPTY_CHUNKS (on since the ninety-second session): split-KV's chunks past
      # kv_end store their max alone and leave before loading q (24 of the 8B's 32 chunks at
      # batch 1, 512 tokens). The micro-benchmark's auto against auto/no-skip (decode and a 1 + 8
      # tree, batch 1 / 8, 512 / 4,096 tokens), then the 8B's decode step at batch 1 with it off /
      # on / off (bench/step_ab.py, alternating in one process) at 512 and 4,096 tokens (~4 min)
      for q in "" "--q-len 9 --tree"; do
        run "split_skip${q:+_tree}" python3 bench/attention_kernel.py --shapes 8b --batches 1 8 \
          --kv-lens 512 4096 --no-ref $q
      done
      for context in 512 4096; do
        run "split_skip_step_$context" python3 bench/step_ab.py --shape llama-8b --batch 1 \
          --context $context --variant off=skip_empty=0 --variant skip=skip_empty=1 \
          --variant off2=skip_empty=0 --reps 3
      done ;;
    wide-tile)  # a verify tree's row blocks of the 8B's 128-wide head (1 + 8 queries x a group of
      # 4 = 64 rows; at 64 keys x 4 warps they spill): key tiles of 32 against 64, 8 warps against
      # 4 (WIDE_BLOCK_N, WIDE_WARPS). The micro-benchmark's split path (auto/bn32, batch 1 / 2 / 4
      # / 8) and single pass (--sweep's 1/bn32, 1/w8, 1/bn32/w8; batch 16 / 32), 512 / 4,096
      # tokens; then the engine's verify 1 + 8 at batch 1 / 32, 512 tokens, 64 keys against 32
      # (bench/step_ab.py --verify-n 8, alternating in one process; ~6 min)
      run wide_split python3 bench/attention_kernel.py --shapes 8b --batches 1 2 4 8 \
        --kv-lens 512 4096 --q-len 9 --tree --no-ref
      run wide_single python3 bench/attention_kernel.py --shapes 8b --batches 16 32 \
        --kv-lens 512 4096 --q-len 9 --tree --no-ref --sweep
      run wide_engine python3 bench/step_ab.py --shape llama-8b --batch 1 32 --verify-n 8 \
        --variant bn64=wide_block_n=64 --variant bn32=wide_block_n=32 \
        --variant bn64b=wide_block_n=64 --reps 3 ;;
    wide-split)  # split-KV's target programs a SM: tests/gpu's attention files, then the 8B's
      # verify 1 + 8 at batch 2 / 4 / 8 / 16 with 3 / 4 / 2 for a tree's wide blocks
      # (WIDE_SPLIT_PROGRAMS_PER_SM), its decode step at batch 4 / 8 / 16 with 3 / 4 / 2 / 3
      # (LARGE_HEAD_SPLIT_PROGRAMS_PER_SM), and SmolLM2's decode step at batch 8 / 32 with 4 / 3 /
      # 2 / 4 (SPLIT_PROGRAMS_PER_SM) (bench/step_ab.py, alternating in one process; three or
      # four variants' KV pools fit one H200 at 4,096 tokens, four of 31 sequences did not) at
      # $WIDE_CONTEXTS tokens (default 4096; each context ~4-5 min with the captures, so
      # WIDE_CONTEXTS="4096 512" in one call may pass 600 s after the tests)
      run wide_split_tests python3 -m pytest -q tests/gpu/test_paged_attention_gpu.py \
        tests/gpu/test_cuda_graph_ragged.py
      for context in ${WIDE_CONTEXTS:-4096}; do
        run "wide_split_$context" python3 bench/step_ab.py --shape llama-8b \
          --batch 2 4 8 16 --verify-n 8 --context "$context" --variant per3=wide_split=3 \
          --variant per4=wide_split=4 --variant per2=wide_split=2 --reps 5
        run "decode_split_$context" python3 bench/step_ab.py --shape llama-8b \
          --batch 4 8 16 --context "$context" --variant per3=split_large=3 \
          --variant per4=split_large=4 --variant per2=split_large=2 \
          --variant per3b=split_large=3 --reps 5
        run "decode_split_smollm2_$context" python3 bench/step_ab.py --shape smollm2-135m \
          --batch 8 32 --context "$context" --variant per4=split=4 --variant per3=split=3 \
          --variant per2=split=2 --variant per4b=split=4 --reps 5
      done ;;
    attention-engine)  # why 3 pipeline stages take the 8B's decode tile from 164.7 to 126.1 us a
      # layer in bench/attention_kernel.py (batch 32, 4,096 tokens, ninetieth session) and leave
      # the engine's step where it was: the micro-benchmark with programmatic dependent launch on
      # and off (its graph chains attention launches back to back), then the engine's kernels
      # (bench/profile_step.py, torch.profiler, PDL off so that each kernel's time is its own) at
      # batch 32, 4,096 tokens, with 2 and 3 stages (~4 min in all)
      for p in 1 0; do
        SPECSPLIT_PDL=$p run "attention_pdl$p" python3 bench/attention_kernel.py --shapes 8b \
          --batches 32 --kv-lens 512 4096 --sweep --no-ref
      done
      for stages in 2 3; do
        SPECSPLIT_PDL=0 run "profile_stages$stages" python3 bench/profile_step.py \
          --shape llama-8b --batch 32 --n 0 --context 4096 --steps 10 --decode-stages $stages
      done ;;
    engine-ab)  # the engines in process, this tree against .gpu/old (`scripts/gpu_old.sh REV`,
      # carried) in turn, $AB_PASSES (default "new1 old1 new2 old2"): the verifier's SmolLM2 decode
      # and verify 1 + 3 steps (bench/gpu_engine.py, random weights, batch 1 / 8 / 32), then the
      # drafter's greedy chain-3 call (bench/draft_step.py, the shipped head, batch 1 / 8); then
      # the split argmax against torch.argmax (bench/argmax_kernel.py)
      passes=${AB_PASSES:-new1 old1 new2 old2}
      in_trees "$passes" engine python3 bench/gpu_engine.py --shape smollm2-135m --batch 1 8 32 \
        --verify-n 3 --verify-batch 1 8 --steps 60 --no-hf
      in_trees "$passes" draft python3 bench/draft_step.py --random-target smollm2-135m \
        --head specsplit/data/eagle3-smollm2 --device cuda:0 --batch 1 8 --shape 3x1x3 \
        --rounds 300
      run argmax python3 bench/argmax_kernel.py ;;
    steps-ab)  # target-only rounds (4 decode steps each, fixed: `up`'s default before the
      # forty-ninth session grew them as measured) at batch 8 / 32 through
      # the services (random SmolLM2), this tree and .gpu/old (`scripts/gpu_old.sh REV`, carried)
      # in turn, twice: a round's own further steps run ahead at 32 (7c7378d) or not; then where a
      # decode step's time goes in process at batch 8 / 32 (kernels against host phases)
      random_smollm2
      in_trees "new1 old1 new2 old2" steps python3 bench/profile_services.py \
        --model /tmp/smollm2_random "${devices[@]}" --drafter eagle3 \
        --draft-model specsplit/data/eagle3-smollm2 --batch 8 32 --max-new-tokens 256 \
        --top 0 --target-only --up-arg=--decode-steps=4
      # rounds of 8 steps (`--decode-steps 8`) now that their own steps run ahead at any batch
      run steps_new_8 python3 bench/profile_services.py --model /tmp/smollm2_random \
        "${devices[@]}" --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
        --batch 8 32 --max-new-tokens 256 --top 0 --target-only --up-arg=--decode-steps=8
      run profile_step_batch python3 bench/profile_step.py --shape smollm2-135m --batch 8 32 \
        --n 0 --steps 30 ;;
    accept-ab)  # greedy acceptance as the Triton walk and as the torch ops, through the services
      # (ahead1's command, SPECSPLIT_TRITON_ACCEPT=1 then 0: the services inherit it), then in
      # process: the round on the device (bench/hinted_launch.py, SmolLM2 shape, batch 1)
      for walk in 1 0; do
        SPECSPLIT_TRITON_ACCEPT=$walk run "ahead1_walk$walk" python3 bench/overlap.py \
          --model "$SMOLLM2_GGUF" "${devices[@]}" --drafter eagle3 \
          --draft-model specsplit/data/eagle3-smollm2 --batch 1 --max-new-tokens 128 --repeat 3 \
          --prompt-groups 8 --modes serial ahead-plain
      done
      for walk in 1 0 1 0; do
        SPECSPLIT_TRITON_ACCEPT=$walk run "hinted_walk$walk" python3 bench/hinted_launch.py \
          --shape smollm2-135m --device cuda:0 --batch 1 8 --rounds 40 --modes plain
      done ;;
    draft-ahead)
      random_smollm2
      run draft_ahead python3 bench/draft_step.py --target /tmp/smollm2_random --device cuda:0 \
        --batch ${DRAFT_BATCHES:-1 4} --shape 3x1x3 --rounds 100 --ahead 2 --ahead-hits --phases \
        --torch-profile --temperature "${DRAFT_TEMPERATURE:-0}" ;;
    affinity)  # `up --cpu-affinity` off and on in turn ($AFFINITY_MODES): draft-ahead at batch 1
      # through the services, random SmolLM2 + the shipped head (bench/profile_services.py
      # unprofiled: the round, the verifier's host work between rounds, the RPC stages); 1024
      # rounds a run, where `up`s of one setup agreed to +-4% (+-15-25% with 128-512)
      random_smollm2
      for pin in ${AFFINITY_MODES:-off on on off}; do
        run "affinity_$pin" python3 bench/profile_services.py --model /tmp/smollm2_random \
          "${devices[@]}" --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
          --batch 1 --max-new-tokens 1024 --top 0 --overlap ahead --up-arg=--cpu-affinity=$pin
      done ;;
    idle-poll)  # the drafter's and verifier's loops polling their round lanes between rounds
      # (`up --idle-poll-ms 20`) against asleep (0), in turn ($IDLE_POLL_MODES), unpinned
      # (up's default; --cpu-affinity on ran alike): batch-1 draft-ahead through the services,
      # random SmolLM2 + the shipped head (bench/profile_services.py unprofiled);
      # $IDLE_POLL_OVERLAP: another --overlap ("auto": up's own), $IDLE_POLL_BATCHES (default 1),
      # $IDLE_POLL_TOKENS (default 1024), $IDLE_POLL_EXTRA: more bench arguments (e.g.
      # "--synthetic-acceptance 0.8,0.7,0.6": rounds of a realistic accepted length)
      random_smollm2
      local_overlap=()
      [[ ${IDLE_POLL_OVERLAP:-ahead} != auto ]] && local_overlap=(--overlap "${IDLE_POLL_OVERLAP:-ahead}")
      pass=0
      for poll in ${IDLE_POLL_MODES:-0 20 20 0}; do
        pass=$((pass + 1))
        # shellcheck disable=SC2086  # the lists are words
        run "idle_poll_${pass}_$poll" python3 bench/profile_services.py \
          --model /tmp/smollm2_random "${devices[@]}" --drafter eagle3 \
          --draft-model specsplit/data/eagle3-smollm2 --batch ${IDLE_POLL_BATCHES:-1} \
          --max-new-tokens ${IDLE_POLL_TOKENS:-1024} --top 0 "${local_overlap[@]}" \
          --up-arg=--idle-poll-ms=$poll ${IDLE_POLL_EXTRA:-}
      done ;;
    ahead1-ups)  # ahead1 with each mode's `up` $AHEAD_UPS times in turn (default 2; target-only
      # timed in each `up`: bench/overlap.py --ups), two runs an `up`
      run ahead1_ups python3 bench/overlap.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --batch 1 \
        --max-new-tokens 128 --repeat 2 --prompt-groups 8 --modes serial ahead-plain \
        --ups "${AHEAD_UPS:-2}" ;;
    knobs1)  # batch-1 draft-ahead's knobs A/B'd in one run ($SMOLLM2_GGUF + the shipped head):
      # ahead-plain as `up` ships it, with 4 guesses (fused once they keep coming since
      # FUSED_CAPTURE_AFTER) and with --chain-rounds off, each mode's `up` twice in turn
      # against serial and each `up`'s target-only (bench/overlap.py --variant, --ups; ~480 s)
      run knobs1 python3 bench/overlap.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --batch 1 \
        --max-new-tokens 128 --repeat 2 --prompt-groups 8 --modes serial ahead-plain \
        --variant=--ahead-guesses=4 --variant=--chain-rounds=off --ups 2 ;;
    chain-auto)  # --chain-rounds auto (the default since 7635dba) against off and serial, each
      # mode's `up` twice in turn ($SMOLLM2_GGUF + the shipped head, batch 1; ~400 s); the
      # services' log (the chain gate's choice) in $OUT/chain_auto_services.log
      run chain_auto python3 bench/overlap.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --batch 1 \
        --max-new-tokens 128 --repeat 2 --prompt-groups 8 --modes serial ahead-plain \
        --variant=--chain-rounds=off --ups 2 --services-log "$out/chain_auto_services.log" ;;
    drift)  # why one `up` runs faster than the next: $DRIFT_UPS `up`s (default 4) of one setup
      # (batch-1 draft-ahead through the services, random SmolLM2 + the shipped head, 1024
      # tokens), each with the GPUs' clocks (nvidia-smi every 100 ms) and the cores its
      # services' threads ran on (ps every 0.5 s) sampled beside it, in /tmp/drift; the last
      # seconds' samples summed up in $OUT/drift_N.txt (bench/drift_summary.py: $OUT takes 8
      # files at most)
      random_smollm2
      mkdir -p /tmp/drift
      for i in $(seq "${DRIFT_UPS:-4}"); do
        nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,utilization.gpu \
          --format=csv,noheader -lms 100 >"/tmp/drift/smi_$i.csv" 2>&1 &
        local_smi=$!
        while true; do
          pids=$(pgrep -d, -f "serve-(verifier|drafter|gateway)")
          [[ -n $pids ]] && { date +%s.%N; ps -Lo pid,tid,psr,pcpu,comm --no-headers -p "$pids"; }
          sleep 0.5
        done >"/tmp/drift/ps_$i.txt" 2>/dev/null &
        local_ps=$!
        run "drift_$i" python3 bench/profile_services.py --model /tmp/smollm2_random \
          "${devices[@]}" --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
          --batch 1 --max-new-tokens 1024 --top 0 --overlap ahead
        ended=$(date +%s.%N)
        kill "$local_smi" "$local_ps"
        python3 bench/drift_summary.py "/tmp/drift/smi_$i.csv" "/tmp/drift/ps_$i.txt" "$ended" |
          tee -a "$out/drift_$i.txt"
      done ;;
    ahead1-pin)  # ahead1 (real weights: $SMOLLM2_GGUF) with each service pinned and not, in turn
      for pin in ${AFFINITY_MODES:-on off}; do
        run "ahead1_pin_$pin" python3 bench/overlap.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
          --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --batch 1 \
          --max-new-tokens 128 --repeat 3 --prompt-groups 8 --modes serial ahead-plain \
          --up-arg=--cpu-affinity=$pin
      done ;;
    probe)  # which CUDA graphs launch slowly (bench/graph_probe.py: each replayed graph's
      # host us a replay() and its nodes), the drafter's (a round, draft-ahead, after hits)
      # and the verifier's (plain, chained and after-the-hint launches), SmolLM2 shapes,
      # batch 1; then the verifier's launches cProfiled
      random_smollm2
      run probe_drafter python3 bench/graph_probe.py --dot-dir "$out/dots_drafter" -- \
        bench/draft_step.py --target /tmp/smollm2_random --device cuda:0 --batch 1 \
        --shape 3x1x3 --rounds 100 --ahead 2 --ahead-hits
      run probe_verifier python3 bench/graph_probe.py --dot-dir "$out/dots_verifier" -- \
        bench/hinted_launch.py --shape smollm2-135m --device cuda:0 --batch 1 --rounds 60
      run hinted_cprofile python3 bench/hinted_launch.py --shape smollm2-135m --device cuda:0 \
        --batch 1 --rounds 60 --profile cprofile ;;
    sessions)
      run sessions python3 bench/sessions.py --model "$SMOLLM2_GGUF" --device cuda:0 \
        --turns 8 --max-new-tokens 32 --passes 3 ;;
    profile)  # target-only: random weights serve when the GGUF is not there
      [[ -n ${SMOLLM2_GGUF:-} ]] || random_smollm2
      run profile python3 bench/profile_services.py --model "${SMOLLM2_GGUF:-/tmp/smollm2_random}" \
        "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --batch 32 \
        --max-new-tokens 64 --target-only ;;
    split)  # a round's cost outside the engines: the protobuf work, the rows on one lane
      # hop, and through the services at batch 1 to 64 (random SmolLM2 + the shipped head)
      random_smollm2
      run wire python3 bench/wire_rounds.py --batch 1 8 32
      run lane_rows python3 bench/lane_rows.py
      run split python3 bench/profile_services.py --model /tmp/smollm2_random "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --batch 1 8 32 64 \
        --max-new-tokens 128 --top 0 ;;
    sampled)  # sampled chains (temperature 1): their draft probabilities' wire cost, a
      # draft round in process, and through the services at batch 1 / 8 / 32 against greedy
      random_smollm2
      run sampled_wire python3 bench/wire_rounds.py --batch 1 8 32 --beside --sampled 256
      for shape in smollm2-135m llama-8b; do
        run "sampled_engine_$shape" python3 bench/gpu_engine.py --shape "$shape" --batch 1 8 32 \
          --verify-n 3 --sampled-n 3 --sampled-top-p 0.9 --no-hf
      done
      for t in 0 1.0; do
        run "sampled_draft_t$t" python3 bench/draft_step.py --target /tmp/smollm2_random \
          --device cuda:0 --batch 1 8 32 --shape 3x1x3 --temperature "$t"
        run "sampled_split_t$t" python3 bench/profile_services.py --model /tmp/smollm2_random \
          "${devices[@]}" --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
          --batch 1 8 32 --max-new-tokens 128 --top 0 --temperature "$t"
      done ;;
    cold)  # first rounds at new batch sizes after the warm-up: kernels built, CUDA graphs
      # captured, seconds; greedy chains, then sampled (temperature 0.7, top-p 0.95: the most
      # common client settings) chains and plain rounds as `up` runs them on a GPU, the plain
      # rounds under penalties (the verifier's rules), greedy chains under a repetition penalty
      # (the drafter's rules too); then what the verifier's graphs take (the whole warm-up, then
      # the acceptance graphs per kind); ~550 s
      random_smollm2
      run cold python3 bench/cold_shapes.py --model /tmp/smollm2_random --device cuda:0
      run cold_top_p python3 bench/cold_shapes.py --model /tmp/smollm2_random --device cuda:0 \
        --temperature 0.7 --top-p 0.95
      run cold_top_p_plain python3 bench/cold_shapes.py --model /tmp/smollm2_random \
        --device cuda:0 --temperature 0.7 --top-p 0.95 --spec 0 --decode-steps 4 --decode-ahead
      cold_rules ;;
    cold-rules)  # cold's runs under logit rules, and the verifier's graphs (~250 s)
      random_smollm2
      cold_rules ;;
    drafter-warmup)  # the drafter's warm-up by phase and expansion key (random SmolLM2 + the
      # shipped head; bench/drafter_warmup.py)
      random_smollm2
      run drafter_warmup python3 bench/drafter_warmup.py --target /tmp/smollm2_random ;;
    kernel-builds)  # the verifier's and the drafter's warm-up with empty compile caches, the
      # Triton kernels built as they come and built ahead side by side (SPECSPLIT_BUILD_AHEAD=1),
      # then warm (random SmolLM2 + the shipped head; bench/kernel_builds.py, ~7 min on an H200)
      random_smollm2
      run kernel_builds python3 bench/kernel_builds.py --model /tmp/smollm2_random ;;
    gguf-load)  # loading a random Llama-3.1-8B-shaped Q4_K GGUF onto the GPU, its tensors
      # dequantized by gguf's numpy on the host against on the GPU (bench/gguf_load.py; writes
      # ~4.6 GB to /tmp once)
      run gguf_load python3 bench/gguf_load.py --shape llama-8b --qtype Q4_K ;;
    pointwise-ab)  # the pointwise Triton kernels (SPECSPLIT_TRITON_POINTWISE=1) against
      # torch.compile's (=0): their GPU tests and the lossless stacks on them; the engine's steps
      # in turn (8B, then SmolLM2 past the small-linear path's rows, and the EAGLE-3 head's
      # draft call); the verifier's and the drafter's warm-up with empty and warm caches
      SPECSPLIT_TRITON_POINTWISE=1 run pointwise_tests python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_pointwise_gpu.py tests/gpu/test_fused_gpu.py tests/gpu/test_cuda_lossless.py
      for pw in 0 1 0 1; do
        SPECSPLIT_TRITON_POINTWISE=$pw run "engine_smollm2_pw$pw" python3 bench/gpu_engine.py \
          --shape smollm2-135m --batch 1 32 64 --verify-n 8 --verify-batch 1 8 --steps 50 --no-hf
        SPECSPLIT_TRITON_POINTWISE=$pw run "draft_pw$pw" python3 bench/draft_step.py \
          --random-target smollm2-135m --head specsplit/data/eagle3-smollm2 --device cuda:0 \
          --batch 1 8 --shape 3x1x3 4x2x8 --rounds 300
      done
      for pw in 0 1; do
        SPECSPLIT_TRITON_POINTWISE=$pw run "engine8b_pw$pw" python3 bench/gpu_engine.py \
          --shape llama-8b --batch 1 32 --verify-n 8 --verify-batch 1 32 --steps 30 \
          --decode-ahead --no-hf --no-eager
      done
      random_smollm2
      for pw in 0 1; do
        SPECSPLIT_TRITON_POINTWISE=$pw run "kernel_builds_pw$pw" python3 bench/kernel_builds.py \
          --model /tmp/smollm2_random --runs cold-off warm-off
      done ;;
    drafter-warmup-ab)  # drafter-warmup in .gpu/old (`scripts/gpu_old.sh REV`, carried) and in
      # this tree, on one machine (the old first, so it fills the compile caches: compare the
      # reserved memory, not the seconds)
      random_smollm2
      in_trees "old new" drafter_warmup python3 bench/drafter_warmup.py --target /tmp/smollm2_random ;;
    graph-memory-ab)  # bench/graph_memory.py (the verifier's warm-up: seconds, memory its graphs
      # keep) in .gpu/old (`scripts/gpu_old.sh REV`, carried) and in this tree, on one machine
      random_smollm2
      in_trees "old new" graph_memory python3 bench/graph_memory.py --model /tmp/smollm2_random ;;
    draft)  # a draft round in process: chains and trees, graphs vs the host expansion
      random_smollm2
      run draft python3 bench/draft_step.py --target /tmp/smollm2_random --device cuda:0 \
        --batch 1 8 32 --shape 3x1x3 5x1x5 4x2x8 5x4x16
      run draft_host python3 bench/draft_step.py --target /tmp/smollm2_random --device cuda:0 \
        --batch 1 8 32 --shape 3x1x3 5x1x5 4x2x8 5x4x16 --host-expansion ;;
    gate)  # the speculation gate: one stream (e2e, a 4x2x8 row ungated beside it), then
      # serial / groups gated vs target-only at batch 1 / 8 / 32 (needs $SMOLLM2_GGUF)
      run gate_e2e python3 bench/e2e.py --model "$SMOLLM2_GGUF" "${devices[@]}" --drafter eagle3 \
        --draft-model specsplit/data/eagle3-smollm2 --max-new-tokens 128 --num-prompts 8 \
        --spec 4x2x8 --speculation-gate on --no-hf
      run gate_overlap python3 bench/overlap.py --model "$SMOLLM2_GGUF" "${devices[@]}" \
        --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 --batch 1 8 32 \
        --max-new-tokens 384 --speculation-gate on --services-log "$out/gate_services.log"
      grep -h "speculation gate" "$out/gate_services.log" | cut -c1-200 ;;
    rope)  # the RoPE + K/V store Triton kernel: its GPU tests, then the engine step and its
      # profile with it (SPECSPLIT_TRITON_ROPE=1) and with torch.compile's kernels (=0)
      run rope_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_rope_store_gpu.py
      for rope in 0 1; do
        SPECSPLIT_TRITON_ROPE=$rope run "engine_smollm2_rope$rope" python3 bench/gpu_engine.py \
          --shape smollm2-135m --batch 1 8 32 --verify-n 8 --verify-batch 1 --steps 50 --no-hf
        SPECSPLIT_TRITON_ROPE=$rope run "profile_rope$rope" python3 bench/profile_step.py \
          --shape smollm2-135m --batch 1 --n 0
      done ;;
    prefill)  # a new sequence's first round (prompt + chain 3): graphs up to 128 tokens, eager
      run prefill_smollm2 python3 bench/gpu_engine.py --shape smollm2-135m --batch 1 \
        --verify-n --verify-batch --steps 20 --no-hf --prefill 20 60 120 200
      run prefill_8b python3 bench/gpu_engine.py --shape llama-8b --batch 1 \
        --verify-n --verify-batch --steps 10 --no-hf --prefill 60 120 200 ;;
    newcomer)  # a round of chains of 3 with a newcomer's prefill beside them (600 tokens: led
      # in past the prefill graphs), and a resume round (33 tokens each), at 4 / 8 / 16 / 32 /
      # 64: in parts (each a graph's replay) and as one launch (eager); then the GPU test
      run newcomer_smollm2 python3 bench/gpu_engine.py --shape smollm2-135m --batch 4 8 16 32 64 \
        --verify-n --verify-batch 4 8 16 32 64 --steps 20 --no-hf --newcomer 40 120 600 \
        --resume 32
      run newcomer_8b python3 bench/gpu_engine.py --shape llama-8b --batch 4 8 16 32 64 \
        --verify-n --verify-batch 4 8 16 32 64 --steps 10 --no-hf --newcomer 40 120 600 \
        --resume 32
      run newcomer_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_graph_parts_gpu.py ;;
    small)  # the fused small-linear layer path (on by default, up to 16 rows): every GPU test
      # with it off, then the engine step and its profile with it off and on
      SPECSPLIT_SMALL_LINEAR=0 run small_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
      for small in 0 1; do
        SPECSPLIT_SMALL_LINEAR=$small run "engine_smollm2_small$small" python3 bench/gpu_engine.py \
          --shape smollm2-135m --batch 1 8 --verify-n 8 --verify-batch 1 --steps 50 --no-hf
        SPECSPLIT_SMALL_LINEAR=$small run "profile_small$small" python3 bench/profile_step.py \
          --shape smollm2-135m --batch 1 --n 0 8
      done ;;
    broadcast)  # the small-linear broadcast path above 4 rows (a bench's switch,
      # $SPECSPLIT_SMALL_LINEAR_BROADCAST_ROWS: 8 / 16 / 32 rows on it, not on tensor cores; 32
      # also moves the small path's limit to 32): its GPU tests at 32, then the engine step in
      # process at batch 1 / 8 / 16 / 32 (rounds of 4 decode steps run ahead) with the limit at
      # 4 (the default), 8, 16 and 32
      SPECSPLIT_SMALL_LINEAR_BROADCAST_ROWS=32 run broadcast_tests python3 -m pytest -q \
        -p no:cacheprovider tests/gpu/test_small_linear_gpu.py
      for rows in 4 8 16 32; do
        SPECSPLIT_SMALL_LINEAR_BROADCAST_ROWS=$rows run "engine_broadcast$rows" python3 \
          bench/gpu_engine.py --shape smollm2-135m --batch 1 8 16 32 --verify-n --verify-batch \
          --steps 100 --no-hf --decode-ahead --decode-steps 4
      done ;;
    tiles)  # the small-linear kernels' tensor-core tiles swept at 8 / 16 / 32 rows against
      # cuBLAS's GEMM alone (bench/small_linear_tiles.py, each call's weights from HBM, at most
      # $TILES_SECONDS, default 200), the kernels' GPU tests with the best tile up to 32 rows,
      # then the engine step in process at batch 8 / 16 / 32: the default path (tensor cores to
      # 16 rows, unfused above) against the small path up to 32 rows on tensor cores with the
      # sweep's best tile (SPECSPLIT_SMALL_LINEAR_DOT_ROWS=32, _DOT_TILES)
      run small_linear_tiles python3 bench/small_linear_tiles.py --max-seconds ${TILES_SECONDS:-200}
      best=$(awk '$1 == "BEST_TILES" && $2 == "all" {print $3}' "$out/small_linear_tiles.txt")
      echo "== the best tile over all rows: ${best:-none (the built-in 16,128,4,4 below)}"
      SPECSPLIT_SMALL_LINEAR_DOT_ROWS=32 SPECSPLIT_SMALL_LINEAR_DOT_TILES=${best:-16,128,4,4} \
        run tiles_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_small_linear_gpu.py \
        -k "matches_reference or graph_replay"
      engine=(python3 bench/gpu_engine.py --shape smollm2-135m --batch 8 16 32 --verify-n
        --verify-batch --steps 100 --no-hf --decode-ahead)
      run engine_tiles_default "${engine[@]}"
      SPECSPLIT_SMALL_LINEAR_DOT_ROWS=32 \
        SPECSPLIT_SMALL_LINEAR_DOT_TILES=${best:-16,128,4,4} run engine_tiles_best \
        "${engine[@]}" ;;
    pdl)  # programmatic dependent launch (SPECSPLIT_PDL=1, triton_jit.pdl): its GPU tests (bit
      # for bit the launches without it) and the small-linear and attention kernels' tests with
      # it on, then the engine's decode step in one process (bench/step_ab.py, random SmolLM2,
      # batch $PDL_BATCHES, default 1 8 16 32) with the switches alternating: the default (PDL
      # on, the tensor-core path at 5-16 rows launched without it), without PDL, unfused above 4
      # rows, PDL on tensor cores too (their dependents launched at once, or after the K loop,
      # with and without the prefetch), the small path to 32 rows ($PDL_VARIANTS replaces them)
      run pdl_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pdl_gpu.py
      run pdl_kernel_tests python3 -m pytest -q -p no:cacheprovider \
        tests/gpu/test_small_linear_gpu.py tests/gpu/test_paged_attention_gpu.py \
        tests/gpu/test_rope_store_gpu.py
      read -ra variants <<<"${PDL_VARIANTS:-base= nopdl=pdl=0 unfused=rows=4 dotpdl=pdl_dot=1 \
        dotpdl-late=pdl_dot=1,late=1 dotpdl-late-nopf=pdl_dot=1,late=1,prefetch=0 small32=rows=32}"
      run step_ab python3 bench/step_ab.py --shape smollm2-135m --batch ${PDL_BATCHES:-1 8 16 32} \
        "${variants[@]/#/--variant=}" --reps ${PDL_REPS:-5} --steps 20 --decode-steps 4 ;;
    prefill-chunk)  # `--prefill-chunk` on a GPU: every 4th of 64 prompts 3,000 tokens long among
      # the chat prompts, 20 requests a second through `up` on the random 8B-shaped target
      # (target only, 128 tokens a stream), whole prompts (0, a GPU's default) against chunks of
      # 512 (a CPU's) and 2,048 tokens a round
      random_8b_1b
      SERVING_MODEL=/tmp/llama8b SERVING_DRAFTER="--drafter eagle3 --draft-model /tmp/eagle8b" \
        SERVING_BASE="whole=--prefill-chunk=0 chunk512=--prefill-chunk=512 chunk2048=--prefill-chunk=2048" \
        SERVING_PROMPT_TOKENS=3000 SERVING_LONG_EVERY=4 SERVING_REQUESTS=64 SERVING_RATES=20 serving ;;
    prefill-chunk-smollm2)  # prefill-chunk on random SmolLM2-shaped weights with the shipped
      # head's drafter (what `up` serves on a GPU), 48 requests, whole against chunks of 512
      random_smollm2
      SERVING_BASE="whole=--prefill-chunk=0 chunk512=--prefill-chunk=512" SERVING_PROMPT_TOKENS=3000 \
        SERVING_LONG_EVERY=4 SERVING_REQUESTS=48 SERVING_RATES=20 serving ;;
    serving)  # requests arriving as a Poisson process through `up` (bench/serving.py: TTFT, TPOT,
      # chunk gaps, tokens/s), random SmolLM2, target only, $SERVING_TOKENS (default 128) tokens
      # a stream past EOS, $SERVING_RATES requests a second (default 20 80 inf),
      # $SERVING_REQUESTS (default 128);
      # `up`'s defaults (adaptive rounds on a GPU) against rounds of 4 ($SERVING_SETUPS: more,
      # NAME=FLAG each, space-separated, e.g. prefill1=--prefill-rounds-one-step)
      # $SERVING_MODEL: another checkpoint (e.g. "$SMOLLM2_GGUF": real weights, the shipped
      # head's real acceptance), $SERVING_SPEC: the requests' draft shape(s) (target default),
      # $SERVING_UPS: `up`s a setup, in turn (medians; default 1); $SERVING_BASE: the setups
      # measured before $SERVING_SETUPS (default "default= steps4=--decode-steps=4");
      # $SERVING_PROMPT_TOKENS: prompts made that long (e.g. 600: past the prefill graphs),
      # $SERVING_LONG_EVERY: only every K-th of them
      # $SERVING_TEMPERATURE: sampled requests at that temperature (seeded by their index)
      [[ -n ${SERVING_MODEL:-} ]] || random_smollm2
      serving ;;
    sampled8b)  # a sampled round against a greedy one on the critical8b system with its logits
      # sharpened ($MIRROR_LOGIT_SCALE, 6 unless set: the top token's probability at T = 1
      # 0.38 / 0.58 / 0.83 by quartile, so a sampled bonus token can be guessed; the mirror is
      # made once a machine), batch $SAMPLED_BATCH (8): serial and draft-ahead at T = 1, serial
      # greedy (bench/profile_services.py unprofiled: the RPC stages, each service's overhead);
      # then the sampled draft call in process (random SmolLM2 + the shipped head, batch 1 / 8)
      # with the cut-and-draw kernel and with its torch ops (SPECSPLIT_CUT_DRAW_KERNEL)
      MIRROR_LOGIT_SCALE=${MIRROR_LOGIT_SCALE:-6} mirror_8b
      for setup in "serial 1.0" "serial 0" "ahead 1.0"; do
        read -r mode temperature <<<"$setup"
        run "sampled8b_${mode}_T$temperature" python3 bench/profile_services.py \
          --model /tmp/mirror8b "${devices[@]}" --drafter model --draft-model /tmp/mirror8b_draft \
          --batch "${SAMPLED_BATCH:-8}" --max-new-tokens 128 --top 0 --overlap "$mode" \
          --temperature "$temperature" --synthetic-acceptance 0.8,0.7,0.6
      done
      random_smollm2
      for kernel in 1 0; do
        SPECSPLIT_CUT_DRAW_KERNEL=$kernel run "sampled8b_draw_kernel$kernel" python3 \
          bench/draft_step.py --target /tmp/smollm2_random --device cuda:0 --batch 1 8 \
          --shape 3x1x3 --rounds 100 --torch-profile --temperature 1.0
      done ;;
    serving8b)  # serving's Poisson arrivals on the 8B-shaped mirror target (random weights) and
      # its one-layer draft model, each setup with --synthetic-acceptance 0.8,0.7,0.6 (timing
      # only: the outputs are not the target's), $SERVING_SPEC default "target default",
      # $SERVING_BASE default "spec= gate=--speculation-gate=on" (bench/serving.py forces
      # speculation on default-spec requests unless a setup turns the gate on)
      mirror_8b
      SERVING_MODEL=/tmp/mirror8b SERVING_SPEC=${SERVING_SPEC:-target default} \
        SERVING_BASE=${SERVING_BASE:-spec= gate=--speculation-gate=on} \
        SERVING_DRAFTER="--drafter model --draft-model /tmp/mirror8b_draft" \
        SERVING_EXTRA="--synthetic-acceptance=0.8,0.7,0.6" serving ;;
    target-split)  # issue 8's split on target-only rounds: the decode step in process (rounds of
      # 4 steps, the next step run ahead), then target-only streams through the services at
      # batch 1 / 8 / 32, $SPLIT_TOKENS (default 1024) tokens each, two runs a batch (random
      # SmolLM2; bench/profile_services.py unprofiled: the round outside the verifier's device)
      random_smollm2
      run engine_steps_ahead python3 bench/gpu_engine.py --shape smollm2-135m --batch 1 8 32 \
        --verify-n --verify-batch --steps 100 --no-hf --decode-ahead --decode-steps 4
      run target_split python3 bench/profile_services.py --model /tmp/smollm2_random \
        "${devices[@]}" --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
        --batch 1 8 32 --max-new-tokens ${SPLIT_TOKENS:-1024} --repeat 2 --top 0 --target-only ;;
    ahead-depth)  # decode steps run ahead after a round's last step (verifier/ahead_depth.py):
      # the decode-ahead GPU tests, then target-only streams through the services at batch 1 /
      # 8 / 32, $SPLIT_TOKENS (default 1024) tokens each, two runs a batch, one `up` for each of
      # $DEPTHS in turn (default "1 0 0 1": one step, auto; random SmolLM2); auto's choices
      # (the verifier's log) from $OUT/ahead_depth_services.log; AHEAD_TESTS=0: no tests
      [[ ${AHEAD_TESTS:-1} == 0 ]] || run ahead_depth_tests python3 -m pytest -q \
        -p no:cacheprovider tests/gpu/test_decode_ahead_gpu.py
      random_smollm2
      n=0
      for d in ${DEPTHS:-1 0 0 1}; do
        n=$((n + 1))
        run "ahead_depth_${n}_d$d" python3 bench/profile_services.py --model /tmp/smollm2_random \
          "${devices[@]}" --drafter eagle3 --draft-model specsplit/data/eagle3-smollm2 \
          --batch 1 8 32 --max-new-tokens ${SPLIT_TOKENS:-1024} --repeat 2 --top 0 \
          --target-only --up-arg=--decode-ahead-depth=$d \
          --services-log "$out/ahead_depth_services.log"
      done
      grep -h "decode-ahead depth" "$out/ahead_depth_services.log" | cut -c1-160 | tail -20
      echo "== ahead-depth: each up, batch 1 | 8 | 32 (scripts/profile_summary.sh)"
      scripts/profile_summary.sh "$out"/ahead_depth_[0-9]*_d*.txt ;;
    profile-depth)  # the services cProfiled at batch 32, target-only streams of 512 tokens, `up`'s
      # defaults but --decode-ahead-depth $PROFILE_DEPTH (default 2): where the verifier's host
      # time goes with steps queued after a round's answer (random SmolLM2)
      random_smollm2
      run "profile_depth${PROFILE_DEPTH:-2}" python3 bench/profile_services.py \
        --model /tmp/smollm2_random "${devices[@]}" --drafter eagle3 \
        --draft-model specsplit/data/eagle3-smollm2 --batch 32 --max-new-tokens 512 --top 40 \
        --sort tottime cumulative --target-only --up-arg=--decode-ahead-depth=${PROFILE_DEPTH:-2} ;;
    graphs)  # CUDA graph launch vs execution, and the engine step with idle gaps between steps
      run graph_launch python3 bench/graph_launch.py --chunks 1 2 5 --steps 200 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
exit $status
