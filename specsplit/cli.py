"""`specsplit`: run the services, all three at once (`up`), or a streamed generation.

Every flag takes its default from a SPECSPLIT_* environment variable (shown in --help), so a
docker-compose file sets the environment and runs `specsplit serve-<service>`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from gateway.request import Limits
    from specsplit.messages import SpecParams
    from specsplit.tls import TLSFiles

DEFAULT_PORTS = {"gateway": 50051, "drafter": 50061, "verifier": 50062}
DEFAULT_HOST = "127.0.0.1"  # every listener, unless told otherwise (DESIGN.md §8)
METRICS_PORTS = {"gateway": 9400, "drafter": 9401, "verifier": 9402}  # Prometheus /metrics
DRAFTER_KINDS = ("auto", "ngram", "self", "model", "eagle3")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

log = logging.getLogger("specsplit.cli")
T = TypeVar("T")


# -- flags -----------------------------------------------------------------------------------


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise SystemExit(f"specsplit: {name}={value!r} is not a boolean ({'/'.join(_TRUE + _FALSE)})")


def _flag(
    parser: argparse.ArgumentParser,
    flag: str,
    default: Any,
    help: str,
    *,
    env: str | None = None,
    type: Callable[[str], Any] = str,
    **kwargs: Any,
) -> None:
    """--flag whose default is $SPECSPLIT_<FLAG> (or $SPECSPLIT_<env>) when set, parsed like a
    command-line value."""
    name = "SPECSPLIT_" + (env or flag.removeprefix("--").replace("-", "_").upper())
    value = os.environ.get(name)
    if value is not None and "choices" in kwargs and type(value) not in kwargs["choices"]:
        raise SystemExit(f"specsplit: {name}={value!r}: choose from {kwargs['choices']}")
    shown = "none" if default is None else default
    help = f"{help} (env {name}, default {shown})"
    default = value if value is not None else default
    parser.add_argument(flag, type=type, default=default, help=help, **kwargs)


def _optional_int(value: str) -> int | None:
    return None if value.lower() in ("", "none") else int(value)


def _model_flags(parser: argparse.ArgumentParser, *, engine: bool = True) -> None:
    _flag(parser, "--model", None, "target checkpoint (directory or .gguf); default: embedded")
    if not engine:
        return
    _flag(parser, "--device", "auto", "torch device; auto = cuda when available")
    dtype_help = "weights and KV dtype; auto = bfloat16 on cuda, float32 on cpu"
    _flag(parser, "--dtype", "auto", dtype_help, choices=DTYPE_CHOICES)
    _flag(parser, "--num-pages", None, "KV cache pages; none = the engine's", type=_optional_int)
    _flag(parser, "--page-size", 16, "tokens per KV page", type=int)


def _verifier_flags(parser: argparse.ArgumentParser) -> None:
    lens_help = (
        "query tokens per sequence of the verify steps captured as CUDA graphs on a GPU "
        "(1 = decode, 1 + num_draft_tokens = verify), comma-separated; none = always eager"
    )
    _flag(parser, "--cuda-graphs", "1,4,5,9,17", lens_help)
    fraction_help = "share of the GPU memory free after loading the weights for the KV cache"
    _flag(
        parser,
        "--kv-memory-fraction",
        0.8,
        fraction_help + " (when --num-pages is not set)",
        type=float,
    )


def graph_query_lens(args: argparse.Namespace) -> tuple[int, ...]:
    if args.cuda_graphs in ("", "none"):
        return ()
    try:
        lens = tuple(sorted({int(x) for x in args.cuda_graphs.split(",")}))
    except ValueError as e:
        raise SystemExit(f"--cuda-graphs {args.cuda_graphs!r}: comma-separated integers") from e
    if not all(0 < n <= 256 for n in lens):
        raise SystemExit(f"--cuda-graphs {args.cuda_graphs!r}: each in [1, 256]")
    return lens


def _drafter_flags(parser: argparse.ArgumentParser) -> None:
    kind_help = (
        "auto (eagle3 with the shipped head on the embedded default target, else ngram), "
        "ngram (prompt lookup), self (target's first --draft-layers), model (--draft-model), "
        "eagle3 (--draft-model = an EAGLE head for --model: EAGLE-3, or the single-layer "
        "EAGLE-1/2 layout, detected from the checkpoint)"
    )
    _flag(parser, "--drafter", "auto", kind_help, choices=DRAFTER_KINDS)
    model_help = (
        "draft checkpoint (--drafter model) or EAGLE head (eagle3; on the embedded target the "
        "shipped head by default)"
    )
    _flag(parser, "--draft-model", None, model_help)
    _flag(parser, "--draft-layers", None, "layers for --drafter self", type=_optional_int)


def _spec_flags(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "--num-steps", 3, "default draft depth; 0 = no drafting", type=int)
    _flag(parser, "--topk", 1, "default children per draft node; 1 = a chain", type=int)
    nodes_help = "default draft tree nodes; none = num_steps * topk"
    _flag(parser, "--num-draft-tokens", None, nodes_help, type=_optional_int)
    _flag(parser, "--max-batch-size", 32, "sequences per round", type=int)
    parser.add_argument(
        "--adaptive-spec",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("SPECSPLIT_ADAPTIVE_SPEC", False),
        help="move each request's draft shape along --adaptive-ladder by its acceptance; requests"
        " with their own spec stay fixed (env SPECSPLIT_ADAPTIVE_SPEC, default off)",
    )
    ladder_help = "--adaptive-spec rungs STEPS[xTOPK[xNODES]],... (plus the default shape)"
    ladder_help += "; none = 1,3,5,5x4x16"
    _flag(parser, "--adaptive-ladder", None, ladder_help, type=_optional_str)


def _generation_flags(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "--max-tokens", 256, "most tokens to generate", type=int)
    _flag(parser, "--temperature", 0.0, "0 = greedy", type=float)
    _flag(parser, "--top-p", 1.0, "nucleus mass in (0, 1]", type=float)
    _flag(parser, "--top-k", 0, "0 = off", type=int)
    _flag(parser, "--seed", None, "sampling seed; none = random", type=_optional_int)
    parser.add_argument("--stop", action="append", help="stop at this string (repeatable)")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("SPECSPLIT_CHAT", True),
        help="send the prompt as a user chat message (env SPECSPLIT_CHAT, default on)",
    )


def _host_flag(parser: argparse.ArgumentParser, what: str) -> None:
    host_help = f"interface {what} listen on when an address names no host (:PORT)"
    _flag(parser, "--host", DEFAULT_HOST, f"{host_help}; 0.0.0.0 = every interface")


def _server_flags(parser: argparse.ArgumentParser, service: str) -> None:
    _host_flag(parser, "this service's listeners (gRPC, metrics, HTTP)")
    listen = f":{DEFAULT_PORTS[service]}"
    _flag(parser, "--listen", listen, "address to listen on", env=f"{service.upper()}_LISTEN")
    _flag(parser, "--grace", 5.0, "seconds running calls get at shutdown", type=float)
    metrics_help = "host:port of Prometheus /metrics; none = off"
    metrics = f":{METRICS_PORTS[service]}"
    _flag(parser, "--metrics-listen", metrics, metrics_help, type=_optional_str)


def _resolve_hosts(args: argparse.Namespace) -> None:
    """Give --host to the listen addresses that name no host (":PORT")."""
    host = getattr(args, "host", None)
    if host is None:
        return
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6
    for name in ("listen", "metrics_listen", "http_listen"):
        address = getattr(args, name, None)
        if isinstance(address, str) and address.startswith(":"):
            setattr(args, name, f"{host}{address}")


def _limit_flags(parser: argparse.ArgumentParser) -> None:
    """What one client request may ask of the gateway (gateway.request.Limits, DESIGN.md §8)."""
    _flag(parser, "--limit-num-steps", 16, "largest spec.num_steps", type=int)
    _flag(parser, "--limit-topk", 8, "largest spec.topk", type=int)
    _flag(parser, "--limit-num-draft-tokens", 64, "largest spec.num_draft_tokens", type=int)
    _flag(parser, "--limit-new-tokens", 4096, "largest max_new_tokens", type=int)
    prompt_help = "largest prompt in UTF-8 bytes (text, chat contents), checked before tokenizing"
    prompt_help += "; none = 32 per token of the model's context"
    _flag(parser, "--limit-prompt-bytes", None, prompt_help, type=_optional_int)
    message_help = "largest request message (gRPC) or body (HTTP) in bytes"
    _flag(parser, "--limit-message-bytes", 4 * 1024 * 1024, message_help, type=int)
    waiting_help = "requests that may wait for a place in the batch; more: RESOURCE_EXHAUSTED"
    _flag(parser, "--max-waiting", 256, f"{waiting_help} (HTTP 429)", type=int)


def request_limits(args: argparse.Namespace) -> Limits:
    from gateway.request import Limits

    return Limits(
        max_num_steps=args.limit_num_steps,
        max_topk=args.limit_topk,
        max_num_draft_tokens=args.limit_num_draft_tokens,
        max_new_tokens=args.limit_new_tokens,
        max_prompt_bytes=args.limit_prompt_bytes,
        max_message_bytes=args.limit_message_bytes,
    )


def _fault_flags(parser: argparse.ArgumentParser, *, up: bool = False) -> None:
    """How faults are ridden out: the gateway's wait for a verifier that went away, and (`up`)
    how often `up` restarts a drafter or verifier that died."""
    wait_help = "seconds running requests wait for a verifier that went away (restarting, loading)"
    _flag(parser, "--verifier-wait", 300.0, f"{wait_help}; then UNAVAILABLE", type=float)
    if up:
        restart_help = "restarts of the drafter or of the verifier allowed per minute; more: stop"
        _flag(parser, "--max-restarts", 5, restart_help, type=int)


def _optional_str(value: str) -> str | None:
    return None if value.lower() in ("", "none") else value


# -- security flags (DESIGN.md §8; gateway/auth.py, specsplit/tls.py) ------------------------------

TLS_HELP = {
    "drafter": "mutual TLS: clients must hold a certificate from --tls-ca (the gateway's)",
    "verifier": "mutual TLS: clients must hold a certificate from --tls-ca (the gateway's)",
    "gateway": "TLS on the client APIs (gRPC and HTTP)",
}


def _tls_flags(parser: argparse.ArgumentParser, service: str) -> None:
    """This service's certificate; on the drafter and verifier also the clients' CA."""
    what = TLS_HELP[service]
    _flag(parser, "--tls-cert", None, f"PEM certificate chain; none = plaintext. {what}")
    _flag(parser, "--tls-key", None, "PEM private key of --tls-cert")
    if service != "gateway":
        _flag(parser, "--tls-ca", None, "PEM CA that issued the clients' certificates")


def _backend_tls_flags(parser: argparse.ArgumentParser) -> None:
    """The gateway's side of the mutual TLS to the drafter and verifier."""
    _flag(parser, "--backend-tls-cert", None, "client certificate shown to drafter and verifier")
    _flag(parser, "--backend-tls-key", None, "PEM private key of --backend-tls-cert")
    _flag(parser, "--backend-tls-ca", None, "PEM CA that issued the drafter's and verifier's")


def _api_key_flags(parser: argparse.ArgumentParser, *, server: bool) -> None:
    """--api-key (repeatable; env SPECSPLIT_API_KEY, comma-separated); resolved to a tuple."""
    help = (
        "accept clients that send 'authorization: Bearer KEY' (repeatable); no key = open"
        if server
        else "send 'authorization: Bearer KEY'"
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"{help} (env SPECSPLIT_API_KEY, comma-separated)",
    )
    if server:
        limit_help = "calls one API key may have in flight; 0 = no limit"
        _flag(parser, "--max-concurrent-per-key", 0, limit_help, type=int)


def _client_tls_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("SPECSPLIT_TLS", False),
        help="connect with TLS, trusting the system's roots unless --tls-ca (env SPECSPLIT_TLS,"
        " default off)",
    )
    _flag(parser, "--tls-ca", None, "PEM CA that issued the gateway's certificate (implies --tls)")


def tls_files(args: argparse.Namespace, prefix: str = "tls") -> TLSFiles:
    """The --tls-* (or --backend-tls-*) files of a serve command."""
    from specsplit.tls import TLSFiles

    return TLSFiles(
        cert=getattr(args, f"{prefix}_cert", None),
        key=getattr(args, f"{prefix}_key", None),
        ca=getattr(args, f"{prefix}_ca", None),
    )


def _http_flags(parser: argparse.ArgumentParser) -> None:
    http_help = "host:port of the OpenAI-compatible HTTP API; none = off"
    _flag(parser, "--http-listen", ":8000", http_help, type=_optional_str)
    name_help = "model id of the HTTP API; none = the model path's name"
    _flag(parser, "--served-model-name", None, name_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specsplit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    levels = ("DEBUG", "INFO", "WARNING", "ERROR")
    _flag(parser, "--log-level", "INFO", "logging level", choices=levels, type=str.upper)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    drafter = commands.add_parser("serve-drafter", help="run the drafter service")
    _server_flags(drafter, "drafter")
    _tls_flags(drafter, "drafter")
    _model_flags(drafter)
    _drafter_flags(drafter)

    verifier = commands.add_parser("serve-verifier", help="run the verifier service")
    _server_flags(verifier, "verifier")
    _tls_flags(verifier, "verifier")
    _model_flags(verifier)
    _verifier_flags(verifier)

    gateway = commands.add_parser("serve-gateway", help="run the gateway (the client API)")
    _server_flags(gateway, "gateway")
    _model_flags(gateway, engine=False)
    for service in ("drafter", "verifier"):
        address = f"localhost:{DEFAULT_PORTS[service]}"
        _flag(gateway, f"--{service}-address", address, f"the {service} to connect to")
    _spec_flags(gateway)
    _fault_flags(gateway)
    _limit_flags(gateway)
    _http_flags(gateway)
    _api_key_flags(gateway, server=True)
    _tls_flags(gateway, "gateway")
    _backend_tls_flags(gateway)

    up = commands.add_parser("up", help="run the three services locally until Ctrl-C")
    _host_flag(up, "the services (gRPC, HTTP, metrics)")
    for service, port in DEFAULT_PORTS.items():
        _flag(up, f"--{service}-port", port, f"{service} port", type=int)
    _model_flags(up)
    _verifier_flags(up)
    _flag(up, "--drafter-device", None, "the drafter's torch device; none = --device")
    _drafter_flags(up)
    _spec_flags(up)
    _fault_flags(up, up=True)
    _limit_flags(up)
    _http_flags(up)
    metrics_help = "gateway's /metrics address; drafter and verifier take the next ports"
    _flag(up, "--metrics-listen", ":9400", f"{metrics_help}; none = off", type=_optional_str)
    _flag(up, "--ready-timeout", 900.0, "seconds to wait for SERVING", type=float)
    _flag(up, "--generate", None, "once serving, stream one generation of this prompt and stop")
    _generation_flags(up)
    _api_key_flags(up, server=True)
    tls_help = "auto = a throwaway local CA: TLS everywhere, mutual TLS to drafter and verifier"
    _flag(up, "--tls", "off", f"{tls_help}; off = plaintext", choices=("off", "auto"))

    generate = commands.add_parser("generate", help="stream a generation from a gateway")
    generate.add_argument("prompt", help="prompt text")
    address = f"localhost:{DEFAULT_PORTS['gateway']}"
    _flag(generate, "--address", address, "the gateway to connect to", env="GATEWAY_ADDRESS")
    _generation_flags(generate)
    _api_key_flags(generate, server=False)
    _client_tls_flags(generate)
    _train_drafter_parser(commands)
    return parser


def _train_drafter_parser(commands: Any) -> None:
    """`specsplit train-drafter`: flags of drafter/train.py."""
    p = commands.add_parser(
        "train-drafter",
        help="train an EAGLE-3 head for a target by self-distillation (drafter/train.py)",
    )
    _model_flags(p, engine=False)
    _flag(p, "--device", "auto", "torch device; auto = cuda when available")
    _flag(p, "--out", "eagle3-head", "output directory (resumes from what it finds there)")
    _flag(p, "--prompts", None, "JSON-lines prompt file; default: the bundled set")
    _flag(p, "--limit-prompts", 0, "use only the first N prompts (0 = all)", type=int)
    _flag(p, "--max-new-tokens", 256, "answer length limit when the target answers", type=int)
    _flag(p, "--answer-batch-size", 64, "prompts answered per generate call", type=int)
    _flag(p, "--answers-per-prompt", 1, "answers per prompt: 1 greedy, the rest sampled", type=int)
    _flag(p, "--answer-temperature", 0.8, "temperature of the sampled answers", type=float)
    _flag(p, "--init-head", None, "start from this head (fine-tune; keeps its draft vocabulary)")
    _flag(p, "--draft-vocab-size", 8192, "draft vocabulary (most frequent answer tokens)", type=int)
    _flag(p, "--ttt-steps", 7, "draft steps unrolled in training (training-time test)", type=int)
    _flag(p, "--step-decay", 0.8, "loss weight of draft step k is decay**k", type=float)
    _flag(p, "--epochs", 10, "passes over the training answers", type=int)
    _flag(p, "--batch-tokens", 16384, "padded tokens per training batch", type=int)
    _flag(p, "--max-len", 1024, "tokens per training sequence (longer ones are cut)", type=int)
    _flag(p, "--lr", 1e-3, "peak learning rate (AdamW)", type=float)
    _flag(p, "--warmup-steps", 50, "linear warm-up steps", type=int)
    _flag(p, "--grad-clip", 0.5, "gradient norm clip", type=float)
    _flag(p, "--save-every", 100, "steps between resumable checkpoints", type=int)
    _flag(p, "--max-minutes", 0.0, "stop (resumable) after this long; 0 = no limit", type=float)
    _flag(p, "--seed", 0, "initialisation and batch order", type=int)
    _flag(p, "--report-prompts", 64, "held-out prompts run through the engines (0: none)", type=int)
    _flag(p, "--report-new-tokens", 128, "tokens generated per held-out prompt", type=int)
    p.add_argument("--skip-report", action="store_true", help="no held-out report at the end")


def _resolve_drafter(args: argparse.Namespace) -> None:
    """--drafter auto: the shipped EAGLE-3 head when the target is the embedded default, else
    n-gram. --drafter eagle3 without --draft-model on the embedded default: the shipped head."""
    if getattr(args, "drafter", None) is None:
        return
    embedded = not args.model
    if args.drafter == "auto":
        args.drafter = "eagle3" if embedded else "ngram"
    if args.drafter == "eagle3" and not args.draft_model and embedded:
        from specsplit.model.loader import embedded_default_head_path

        args.draft_model = embedded_default_head_path()


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-flag rules argparse cannot express."""
    if hasattr(args, "api_key"):
        from gateway.auth import parse_keys

        args.api_key = parse_keys(args.api_key, os.environ.get("SPECSPLIT_API_KEY"))
    if args.command.startswith("serve-"):
        mutual = args.command != "serve-gateway"
        try:
            tls_files(args).check(f"--tls-* of {args.command}", require_ca=mutual)
            tls_files(args, "backend_tls").check("--backend-tls-*", require_cert=False)
        except ValueError as err:
            parser.error(str(err))
    if getattr(args, "drafter", None) in ("model", "eagle3") and not args.draft_model:
        parser.error(f"--drafter {args.drafter} needs --draft-model")
    if getattr(args, "drafter", None) == "self" and not args.draft_layers:
        parser.error("--drafter self needs --draft-layers K (K > 0)")
    if hasattr(args, "num_steps"):
        from specsplit.errors import ServiceError

        try:
            default_spec(args).validate()
        except ServiceError as err:
            parser.error(f"default {err.message}")
        for name in ("num_steps", "topk", "num_draft_tokens"):
            value, limit = getattr(default_spec(args), name), getattr(args, f"limit_{name}")
            if value > limit:
                flag = "--limit-" + name.replace("_", "-")
                parser.error(f"the default {name} {value} is over {flag} {limit}")
        try:
            adaptive_rungs(args)
        except ValueError as err:
            parser.error(f"--adaptive-ladder: {err}")


def default_spec(args: argparse.Namespace) -> SpecParams:
    from specsplit.messages import SpecParams

    nodes = args.num_draft_tokens
    if nodes is None:
        nodes = args.num_steps * args.topk
    return SpecParams(num_steps=args.num_steps, topk=args.topk, num_draft_tokens=nodes)


def adaptive_rungs(args: argparse.Namespace) -> tuple[SpecParams, ...] | None:
    """The --adaptive-ladder rungs; None = gateway.adaptive's default ladder."""
    from gateway.adaptive import parse_ladder

    return None if args.adaptive_ladder is None else parse_ladder(args.adaptive_ladder)


# -- the serve commands ----------------------------------------------------------------------


def _model_path(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    from specsplit.model.loader import embedded_default_model_path

    return embedded_default_model_path()


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """device, dtype ("auto" resolved), num_pages, page_size, grace and tls of a serve
    command."""
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    sizes = {"num_pages": args.num_pages, "page_size": args.page_size}
    return {"device": device, "dtype": dtype, **sizes, "grace": args.grace, "tls": tls_files(args)}


def serve_drafter(args: argparse.Namespace) -> int:
    from drafter.main import serve

    model_path = args.draft_model if args.drafter in ("model", "eagle3") else None
    if args.drafter == "self":  # the target's first layers
        model_path = _model_path(args)
    target_path = _model_path(args) if args.drafter == "eagle3" else None  # its embeddings
    kwargs = _engine_kwargs(args)
    asyncio.run(
        serve(
            args.listen,
            args.drafter,
            model_path,
            draft_layers=args.draft_layers,
            target_path=target_path,
            **kwargs,
        )
    )
    return 0


def serve_verifier(args: argparse.Namespace) -> int:
    from verifier.main import serve

    graphs = {
        "graph_query_lens": graph_query_lens(args),
        "kv_memory_fraction": args.kv_memory_fraction,
    }
    asyncio.run(serve(args.listen, _model_path(args), **_engine_kwargs(args), **graphs))
    return 0


def serve_gateway(args: argparse.Namespace) -> int:
    from gateway.auth import ApiKeys
    from gateway.main import serve

    backends = {"drafter_address": args.drafter_address, "verifier_address": args.verifier_address}
    limits = {"max_batch_size": args.max_batch_size, "grace": args.grace}
    adaptive = {"adaptive_spec": args.adaptive_spec, "adaptive_rungs": adaptive_rungs(args)}
    http = {"http_listen": args.http_listen, "served_model_name": args.served_model_name}
    keys = ApiKeys(args.api_key, args.max_concurrent_per_key)
    model_path = _model_path(args)
    asyncio.run(
        serve(
            args.listen,
            model_path,
            **backends,
            default_spec=default_spec(args),
            **adaptive,
            **limits,
            **http,
            api_keys=keys,
            tls=tls_files(args),
            backend_tls=tls_files(args, "backend_tls"),
            limits=request_limits(args),
            max_waiting=args.max_waiting,
            verifier_wait_s=args.verifier_wait,
        )
    )
    return 0


# -- generate --------------------------------------------------------------------------------


async def stream_generation(
    address: str, prompt: str, args: argparse.Namespace, tls: TLSFiles | None = None
) -> int:
    """Stream text to stdout as it arrives; stats to stderr at the end. Returns an exit code.
    Sends args.api_key's first key; tls: how to trust the gateway (None = args.tls, args.tls_ca:
    plaintext unless one is set)."""
    import grpc

    from specsplit.server import CHANNEL_OPTIONS
    from specsplit.tls import channel_credentials
    from specsplit.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    sampling = common_pb2.SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    if args.seed is not None:
        sampling.seed = args.seed
    request = gateway_pb2.GenerateRequest(
        max_new_tokens=args.max_tokens, sampling=sampling, stop=args.stop or []
    )
    if args.chat:
        request.chat.messages.add(role="user", content=prompt)
    else:
        request.text = prompt
    started = time.monotonic()
    last = gateway_pb2.GenerateResponse()
    first_token_ns: int | None = None
    if tls is None and (getattr(args, "tls", False) is True or getattr(args, "tls_ca", None)):
        tls = tls_files(args)  # only a CA (or none: the system's roots)
    channel = (
        grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        if tls is None
        else grpc.aio.secure_channel(address, channel_credentials(tls), options=CHANNEL_OPTIONS)
    )
    api_keys = getattr(args, "api_key", ())
    metadata = (("authorization", f"Bearer {api_keys[0]}"),) if api_keys else None
    async with channel:
        try:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            async for response in stub.Generate(request, metadata=metadata):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if first_token_ns is None and response.token_ids:
                    first_token_ns = response.elapsed_ns
                last = response
        except grpc.aio.AioRpcError as err:
            print("\n" if last.ByteSize() else "", end="", flush=True)
            print(f"specsplit: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(flush=True)
    seconds = time.monotonic() - started
    stats, usage = last.spec_stats, last.usage
    reason = gateway_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_")
    print(
        f"[{reason.lower()}] {usage.prompt_tokens} prompt + {usage.completion_tokens} generated "
        f"tokens in {seconds:.2f} s ({usage.completion_tokens / seconds:.1f} tokens/s, first "
        f"token after {(first_token_ns or 0) / 1e6:.0f} ms); {stats.rounds} rounds, "
        f"{stats.num_accepted_drafts} drafts accepted, {stats.mean_accepted_tokens:.2f} "
        f"tokens per round",
        file=sys.stderr,
    )
    return 0


def generate(args: argparse.Namespace) -> int:
    return asyncio.run(stream_generation(args.address, args.prompt, args))


def up(args: argparse.Namespace) -> int:
    from specsplit.up import run_up

    return run_up(args)


def train_drafter(args: argparse.Namespace) -> int:
    from drafter.train import train_drafter as run

    return run(args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve-drafter": serve_drafter,
    "serve-verifier": serve_verifier,
    "serve-gateway": serve_gateway,
    "up": up,
    "generate": generate,
    "train-drafter": train_drafter,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    _resolve_hosts(args)
    _resolve_drafter(args)
    _check(parser, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    service = args.command.removeprefix("serve-")
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )
    if args.command.startswith("serve-"):
        quiet_progress_bars()
        _start_observability(service, args.metrics_listen)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    finally:
        # Exiting: spare the interpreter's last garbage collections over torch's and
        # transformers' objects (measured 1-2 s on a 2-core box), time a stop's grace is for.
        gc.freeze()


def quiet_progress_bars() -> None:
    """No tqdm bars in a service (transformers draws one converting a GGUF file): the services
    of `specsplit up` share a terminal, where their bars overwrite each other on one line; the
    engine logs its loading progress instead. Before anything imports tqdm (it reads its
    TQDM_* environment once); TQDM_DISABLE=0 keeps them."""
    os.environ.setdefault("TQDM_DISABLE", "1")


def _start_observability(service: str, metrics_listen: str | None) -> None:
    """Prometheus /metrics (unless "none") and OpenTelemetry tracing (when OTEL_* ask for it)."""
    from specsplit import metrics, telemetry

    metrics.serve(metrics_listen)
    telemetry.init(service)


if __name__ == "__main__":
    sys.exit(main())
