"""The serve commands' listener, round lane, limit, fault and security flags (DESIGN.md §8;
gateway/auth.py, specsplit/tls.py) and what the serve commands read back from them (request
limits, TLS files).

Service modules are imported inside the functions that need them: the command line starts
without torch.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from specsplit.cli_args import (
    cpu_cores,
    flag,
    optional_float,
    optional_int,
    optional_str,
    switch,
)

if TYPE_CHECKING:
    from gateway.request import Limits
    from specsplit.tls import TLSFiles

DEFAULT_PORTS = {"gateway": 50051, "drafter": 50061, "verifier": 50062}
DEFAULT_HOST = "127.0.0.1"  # every listener, unless told otherwise (DESIGN.md §8)
METRICS_PORTS = {"gateway": 9400, "drafter": 9401, "verifier": 9402}  # Prometheus /metrics


def host_flag(parser: argparse.ArgumentParser, what: str) -> None:
    host_help = f"interface {what} listen on when an address names no host (:PORT)"
    flag(parser, "--host", DEFAULT_HOST, f"{host_help}; 0.0.0.0 = every interface")


def round_lane_flag(parser: argparse.ArgumentParser) -> None:
    lane_help = (
        "on: a drafter or verifier on a Unix socket takes its rounds, Release and Truncate on"
        " its round lane (the same messages as frames on a plain socket beside it, about half"
        " gRPC's round trip); off: everything on gRPC"
    )
    flag(parser, "--round-lane", "on", lane_help, choices=("on", "off"))
    poll_help = (
        "how long the gateway's event loop polls for a round lane's answer before it sleeps"
        " (waking from a sleep through an engine call costs ~0.1 ms on a GPU host); none ="
        " auto (`up`: 5 when the verifier runs on a GPU, else 0; serve-gateway: 0); polling"
        " takes a core that a CPU engine needs"
    )
    flag(parser, "--round-lane-poll-ms", None, poll_help, type=optional_float)


def server_flags(parser: argparse.ArgumentParser, service: str) -> None:
    host_flag(parser, "this service's listeners (gRPC, metrics, HTTP)")
    listen = f":{DEFAULT_PORTS[service]}"
    flag(parser, "--listen", listen, "address to listen on", env=f"{service.upper()}_LISTEN")
    flag(parser, "--grace", 5.0, "seconds running calls get at shutdown", type=float)
    metrics_help = "host:port of Prometheus /metrics; none = off"
    metrics = f":{METRICS_PORTS[service]}"
    flag(parser, "--metrics-listen", metrics, metrics_help, type=optional_str)
    cores_help = (
        "cores (e.g. 30,31) every thread of the service runs on once it is loaded, before it"
        " reports SERVING (`up --cpu-affinity` sets it); none = where the OS puts them"
    )
    flag(parser, "--cpu-cores", None, cores_help, type=cpu_cores)


def resolve_hosts(args: argparse.Namespace) -> None:
    """Give --host to the listen addresses that name no host (":PORT")."""
    host = getattr(args, "host", None)
    if host is None:
        return
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6
    for name in ("listen", "metrics_listen", "http_listen"):
        address = getattr(args, name, None)
        if isinstance(address, str) and address.startswith(":"):
            setattr(args, name, f"{host}{address}")


def limit_flags(parser: argparse.ArgumentParser) -> None:
    """What one client request may ask of the gateway (gateway.request.Limits, DESIGN.md §8)."""
    flag(parser, "--limit-num-steps", 16, "largest spec.num_steps", type=int)
    flag(parser, "--limit-topk", 8, "largest spec.topk", type=int)
    flag(parser, "--limit-num-draft-tokens", 64, "largest spec.num_draft_tokens", type=int)
    flag(parser, "--limit-new-tokens", 4096, "largest max_new_tokens", type=int)
    prompt_help = "largest prompt in UTF-8 bytes (text, chat contents), checked before tokenizing"
    prompt_help += "; none = 32 per token of the model's context"
    flag(parser, "--limit-prompt-bytes", None, prompt_help, type=optional_int)
    message_help = "largest request message (gRPC) or body (HTTP) in bytes"
    flag(parser, "--limit-message-bytes", 4 * 1024 * 1024, message_help, type=int)
    waiting_help = "requests that may wait for a place in the batch; more: RESOURCE_EXHAUSTED"
    flag(parser, "--max-waiting", 256, f"{waiting_help} (HTTP 429)", type=int)
    ttl_help = "seconds an idle session keeps its KV before it expires (OpenSession may ask less"
    flag(parser, "--session-ttl", 600.0, f"{ttl_help} or more)", type=float)


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


def fault_flags(parser: argparse.ArgumentParser, *, up: bool = False) -> None:
    """How faults are ridden out: the gateway's wait for a verifier that went away, and (`up`)
    how often `up` restarts a drafter or verifier that died."""
    wait_help = "seconds running requests wait for a verifier that went away (restarting, loading)"
    flag(parser, "--verifier-wait", 300.0, f"{wait_help}; then UNAVAILABLE", type=float)
    if up:
        restart_help = "restarts of the drafter or of the verifier allowed per minute; more: stop"
        flag(parser, "--max-restarts", 5, restart_help, type=int)


# -- security flags (DESIGN.md §8; gateway/auth.py, specsplit/tls.py) ------------------------------

TLS_HELP = {
    "drafter": "mutual TLS: clients must hold a certificate from --tls-ca (the gateway's)",
    "verifier": "mutual TLS: clients must hold a certificate from --tls-ca (the gateway's)",
    "gateway": "TLS on the client APIs (gRPC and HTTP)",
}


def tls_flags(parser: argparse.ArgumentParser, service: str) -> None:
    """This service's certificate; on the drafter and verifier also the clients' CA."""
    what = TLS_HELP[service]
    flag(parser, "--tls-cert", None, f"PEM certificate chain; none = plaintext. {what}")
    flag(parser, "--tls-key", None, "PEM private key of --tls-cert")
    if service != "gateway":
        flag(parser, "--tls-ca", None, "PEM CA that issued the clients' certificates")


def backend_tls_flags(parser: argparse.ArgumentParser) -> None:
    """The gateway's side of the mutual TLS to the drafter and verifier."""
    flag(parser, "--backend-tls-cert", None, "client certificate shown to drafter and verifier")
    flag(parser, "--backend-tls-key", None, "PEM private key of --backend-tls-cert")
    flag(parser, "--backend-tls-ca", None, "PEM CA that issued the drafter's and verifier's")


def api_key_flags(parser: argparse.ArgumentParser, *, server: bool) -> None:
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
        flag(parser, "--max-concurrent-per-key", 0, limit_help, type=int)


def client_tls_flags(parser: argparse.ArgumentParser) -> None:
    switch(parser, "--tls", False, "connect with TLS, trusting the system's roots unless --tls-ca")
    flag(parser, "--tls-ca", None, "PEM CA that issued the gateway's certificate (implies --tls)")


def tls_files(args: argparse.Namespace, prefix: str = "tls") -> TLSFiles:
    """The --tls-* (or --backend-tls-*) files of a serve command."""
    from specsplit.tls import TLSFiles

    return TLSFiles(
        cert=getattr(args, f"{prefix}_cert", None),
        key=getattr(args, f"{prefix}_key", None),
        ca=getattr(args, f"{prefix}_ca", None),
    )


def http_flags(parser: argparse.ArgumentParser) -> None:
    http_help = "host:port of the OpenAI-compatible HTTP API; none = off"
    flag(parser, "--http-listen", ":8000", http_help, type=optional_str)
    name_help = "model id of the HTTP API; none = the model path's name"
    flag(parser, "--served-model-name", None, name_help)
