#!/usr/bin/env bash
# One line per bench/profile_services.py output file: its name, then per batch (in the file's
# order) the runs' median tok/s, the verifier GPU's busy share and the round's time outside the
# GPU at p50 (CUDA events; histogram bucket bound, ms). Used by scripts/gpu_suite.sh to sum up
# an A/B of `up`s (e.g. ahead-depth) in the call's last lines.
#   scripts/profile_summary.sh FILE...
set -uo pipefail
for f in "$@"; do
  awk -v name="$(basename "$f" .txt)" '
    /^unprofiled runs:/ { tok = $NF }
    /verifier GPU busy in the rounds:/ { busy = $7 }
    /round outside the verifier.s device \(CUDA events\): p50/ {
      p50 = $0; sub(/.*p50 <= /, "", p50); sub(/ ms.*/, "", p50)
      line = line sprintf("  %s tok/s busy %s out p50<=%s |", tok, busy, p50)
    }
    END { printf "%-22s%s\n", name, line }
  ' "$f"
done
