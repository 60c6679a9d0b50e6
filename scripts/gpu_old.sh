#!/usr/bin/env bash
# .gpu/old: the tree of git revision REV (its code and benches; not its data, tests or docs, so
# that it travels beside .whl and a GGUF part in one device call) for A/B runs on a lent GPU
# machine: carry ".gpu/old", then `scripts/gpu_suite.sh ahead1-ab` runs issue 9's batch-1
# bench in this tree and in that one on the same machine.
#   scripts/gpu_old.sh REV
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: scripts/gpu_old.sh REV}
mkdir -p .git/info && touch .git/info/exclude
grep -qx /.gpu/ .git/info/exclude || echo /.gpu/ >> .git/info/exclude
rm -rf .gpu/old && mkdir -p .gpu/old
git archive "$rev" | tar -x -C .gpu/old
rm -rf .gpu/old/specsplit/data .gpu/old/tests .gpu/old/docs
echo ".gpu/old: $(git rev-parse --short "$rev"), $(du -sh .gpu/old | cut -f1)"
