"""The `specsplit` command line: every subcommand parses, SPECSPLIT_* env defaults apply, flags
beat the environment, `up` starts children whose argv parses back to the same settings."""

from __future__ import annotations

import argparse
import asyncio
import importlib.machinery
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from specsplit import affinity, cli, cli_flags, cli_serve, up, up_services
from specsplit.messages import SpecParams
from specsplit.model.embedded import embedded_default_head_path


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SPECSPLIT_* variable of the developer's shell leaks into a test."""
    for name in list(os.environ):
        if name.startswith("SPECSPLIT_"):
            monkeypatch.delenv(name)


def test_every_subcommand_has_a_handler() -> None:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    assert set(subparsers.choices or {}) == set(cli.COMMANDS)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["serve-drafter"], {"listen": "127.0.0.1:50061", "device": "auto"}),
        (["serve-verifier"], {"listen": "127.0.0.1:50062", "dtype": "auto", "num_pages": None}),
        (
            ["serve-gateway"],
            {
                "listen": "127.0.0.1:50051",
                "drafter_address": "localhost:50061",
                "verifier_address": "localhost:50062",
                "num_steps": 3,
                "topk": 1,
                "num_draft_tokens": None,
                "max_batch_size": 64,
                "adaptive_spec": False,
                "adaptive_ladder": None,
            },
        ),
        (
            ["up"],
            {
                "host": "127.0.0.1",
                "gateway_port": 50051,
                "drafter_port": 50061,
                "verifier_port": 50062,
                "generate": None,
                "model": None,
            },
        ),
        (
            ["generate", "hi"],
            {
                "prompt": "hi",
                "address": "localhost:50051",
                "max_tokens": 256,
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": 0,
                "seed": None,
                "chat": True,
            },
        ),
    ],
)
def test_subcommand_defaults(argv: list[str], expected: dict[str, object]) -> None:
    args = cli.parse_args(argv)
    assert args.command == argv[0]
    assert args.log_level == "INFO"
    for name, value in expected.items():
        assert getattr(args, name) == value, name


def test_env_defaults_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "SPECSPLIT_LOG_LEVEL": "debug",
        "SPECSPLIT_MODEL": "/models/target.gguf",
        "SPECSPLIT_DEVICE": "cuda:1",
        "SPECSPLIT_DTYPE": "bfloat16",
        "SPECSPLIT_NUM_PAGES": "4096",
        "SPECSPLIT_PAGE_SIZE": "32",
        "SPECSPLIT_DRAFTER": "self",
        "SPECSPLIT_DRAFT_LAYERS": "8",
        "SPECSPLIT_DRAFTER_LISTEN": "0.0.0.0:7001",
        "SPECSPLIT_GRACE": "2.5",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = cli.parse_args(["serve-drafter"])
    assert args.log_level == "DEBUG"
    assert args.model == "/models/target.gguf"
    assert (args.device, args.dtype) == ("cuda:1", "bfloat16")
    assert (args.num_pages, args.page_size) == (4096, 32)
    assert (args.drafter, args.draft_layers) == ("self", 8)
    assert args.listen == "0.0.0.0:7001"
    assert args.grace == 2.5


def test_listen_env_is_per_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSPLIT_VERIFIER_LISTEN", "[::]:9")
    assert cli.parse_args(["serve-verifier"]).listen == "[::]:9"
    assert cli.parse_args(["serve-drafter"]).listen == "127.0.0.1:50061"


def test_gateway_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSPLIT_DRAFTER_ADDRESS", "drafter:50061")
    monkeypatch.setenv("SPECSPLIT_VERIFIER_ADDRESS", "verifier:50062")
    monkeypatch.setenv("SPECSPLIT_NUM_STEPS", "3")
    monkeypatch.setenv("SPECSPLIT_TOPK", "2")
    args = cli.parse_args(["serve-gateway"])
    assert (args.drafter_address, args.verifier_address) == ("drafter:50061", "verifier:50062")
    assert cli_flags.default_spec(args) == SpecParams(num_steps=3, topk=2, num_draft_tokens=6)


def test_adaptive_spec_flags_and_env(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.adaptive import DEFAULT_LADDER

    assert cli_flags.adaptive_rungs(cli.parse_args(["serve-gateway"])) is None  # the default ladder
    with pytest.raises(SystemExit):
        cli.parse_args(["serve-gateway", "--help"])
    assert f"none = {DEFAULT_LADDER}" in " ".join(capsys.readouterr().out.split())
    monkeypatch.setenv("SPECSPLIT_ADAPTIVE_SPEC", "on")
    monkeypatch.setenv("SPECSPLIT_ADAPTIVE_LADDER", "2,4x2x6")
    args = cli.parse_args(["serve-gateway"])
    assert args.adaptive_spec is True
    assert cli_flags.adaptive_rungs(args) == (SpecParams(2, 1, 2), SpecParams(4, 2, 6))
    assert cli.parse_args(["serve-gateway", "--no-adaptive-spec"]).adaptive_spec is False


def test_generate_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSPLIT_GATEWAY_ADDRESS", "gw:1")
    monkeypatch.setenv("SPECSPLIT_TEMPERATURE", "0.7")
    monkeypatch.setenv("SPECSPLIT_SEED", "42")
    monkeypatch.setenv("SPECSPLIT_CHAT", "off")
    args = cli.parse_args(["generate", "hello"])
    assert (args.address, args.temperature, args.seed, args.chat) == ("gw:1", 0.7, 42, False)
    assert cli.parse_args(["generate", "hello", "--chat"]).chat is True


def test_flags_beat_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSPLIT_MAX_TOKENS", "10")
    monkeypatch.setenv("SPECSPLIT_DEVICE", "cuda")
    assert cli.parse_args(["generate", "x", "--max-tokens", "20"]).max_tokens == 20
    assert cli.parse_args(["serve-verifier", "--device", "cpu"]).device == "cpu"


@pytest.mark.parametrize("command", ["serve-gateway", "up"])
@pytest.mark.parametrize("flag", ["--max-batch-size", "--page-size"])
def test_a_batch_or_page_of_no_size_is_refused(
    command: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """0 sequences a round would never admit a request; 0 tokens a page has no KV."""
    if flag == "--page-size" and command == "serve-gateway":
        command = "serve-verifier"
    for value in ("0", "-3", "x"):
        with pytest.raises(SystemExit):
            cli.parse_args([command, flag, value])
        assert flag in capsys.readouterr().err
    assert getattr(cli.parse_args([command, flag, "1"]), flag[2:].replace("-", "_")) == 1


def test_bad_env_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSPLIT_DRAFTER", "eagle")
    with pytest.raises(SystemExit, match="SPECSPLIT_DRAFTER='eagle'"):
        cli.build_parser()


def test_bad_env_bool_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSPLIT_CHAT", "maybe")
    with pytest.raises(SystemExit, match="SPECSPLIT_CHAT='maybe' is not a boolean"):
        cli.build_parser()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve-drafter", "--drafter", "model"], "--drafter model needs --draft-model"),
        (["up", "--drafter", "self"], "--drafter self needs --draft-layers"),
        (["serve-gateway", "--num-steps", "4", "--num-draft-tokens", "7"], "spec.num_draft_tokens"),
        (["serve-gateway", "--topk", "0"], "spec.topk = 0"),
        (["serve-gateway", "--adaptive-ladder", "3,3x2x1"], "--adaptive-ladder: ladder rung"),
        (["up", "--adaptive-ladder", "3,x"], "is not STEPS[xTOPK[xNODES]]"),
        (["up", "--internal-transport", "unix", "--tls", "auto"], "runs on TCP loopback"),
        (["serve-verifier", "--dtype", "int8"], "invalid choice: 'int8'"),
    ],
)
def test_inconsistent_flags_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_default_spec_derives_num_draft_tokens() -> None:
    args = cli.parse_args(["serve-gateway", "--num-steps", "3", "--topk", "4"])
    assert cli_flags.default_spec(args) == SpecParams(3, 4, 12)
    args = cli.parse_args(["serve-gateway", "--num-steps", "0"])
    assert cli_flags.default_spec(args) == SpecParams(0, 1, 0)
    argv = ["serve-gateway", "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "5"]
    args = cli.parse_args(argv)
    assert cli_flags.default_spec(args) == SpecParams(3, 2, 5)


def _child_args(argv: list[str]) -> argparse.Namespace:
    assert argv[:3] == [sys.executable, "-m", "specsplit.cli"]
    return cli.parse_args(argv[3:])


def test_up_children_parse_back_to_the_same_settings() -> None:
    argv = (
        "--log-level warning up --model /m/t --device cuda:0 --drafter-device cuda:1"
        " --dtype bfloat16 --num-pages 99 --drafter self --draft-layers 6 --num-steps 5 --topk 2"
        " --num-draft-tokens 9 --gateway-port 7000 --drafter-port 7001 --verifier-port 7002"
        " --max-batch-size 8 --adaptive-spec --adaptive-ladder 2,4x2"
    )
    args = cli.parse_args(argv.split())
    commands = up.child_commands(args)
    assert list(commands) == ["verifier", "drafter", "gateway"]
    verifier = _child_args(commands["verifier"])
    drafter = _child_args(commands["drafter"])
    gateway = _child_args(commands["gateway"])
    for child in (verifier, drafter, gateway):
        assert child.log_level == "WARNING"
        assert child.model == "/m/t"
    assert (verifier.command, verifier.listen) == ("serve-verifier", "127.0.0.1:7002")
    assert verifier.device == "cuda:0"
    assert (verifier.dtype, verifier.num_pages, verifier.page_size) == ("bfloat16", 99, 16)
    assert (drafter.listen, drafter.device) == ("127.0.0.1:7001", "cuda:1")
    assert (drafter.drafter, drafter.draft_layers) == ("self", 6)
    assert gateway.listen == "127.0.0.1:7000"
    assert gateway.drafter_address == "127.0.0.1:7001"
    assert gateway.verifier_address == "127.0.0.1:7002"
    assert gateway.max_batch_size == 8
    assert cli_flags.default_spec(gateway) == SpecParams(5, 2, 9)
    assert gateway.adaptive_spec is True
    assert cli_flags.adaptive_rungs(gateway) == (SpecParams(2, 1, 2), SpecParams(4, 2, 8))


def test_up_passes_the_http_api_flags_to_the_gateway() -> None:
    argv = ["up", "--http-listen", "127.0.0.1:9000", "--served-model-name", "m"]
    gateway = _child_args(up.child_commands(cli.parse_args(argv))["gateway"])
    assert (gateway.http_listen, gateway.served_model_name) == ("127.0.0.1:9000", "m")
    off = _child_args(up.child_commands(cli.parse_args(["up", "--http-listen", "none"]))["gateway"])
    assert (off.http_listen, off.served_model_name) == (None, None)


def test_up_children_use_the_embedded_model_by_default() -> None:
    commands = up.child_commands(cli.parse_args(["up"]))
    assert all("--model" not in argv for argv in commands.values())
    drafter = _child_args(commands["drafter"])
    assert drafter.device == "auto"
    drafter = _child_args(up.child_commands(cli.parse_args(["up", "--device", "cuda"]))["drafter"])
    assert (drafter.drafter, drafter.draft_model) == ("eagle3", embedded_default_head_path())


@pytest.mark.parametrize(
    ("argv", "lookup"),
    [
        (["--device", "cpu"], cli_flags.DECODE_LOOKUP_ON_CPU),
        (["--device", "cuda:0"], 0),
        (["--device", "cpu", "--decode-lookup", "5"], 5),
        (["--device", "cuda:0", "--decode-lookup", "2"], 2),
    ],
)
def test_up_gives_the_gateway_prompt_lookup_in_steps_on_a_cpu(argv: list[str], lookup: int) -> None:
    gateway = _child_args(up.child_commands(cli.parse_args(["up", *argv]))["gateway"])
    assert gateway.decode_lookup == lookup
    assert gateway.decode_lookup_max_batch == 2  # (two streams: where it paid on the CPU)
    assert cli.parse_args(["serve-gateway"]).decode_lookup is None  # the gateway takes 0


def test_auto_drafter_is_the_shipped_head_on_a_gpu_else_prompt_lookup() -> None:
    embedded = cli.parse_args(["serve-drafter", "--device", "cuda:0"])
    assert (embedded.drafter, embedded.draft_model) == ("eagle3", embedded_default_head_path())
    assert (Path(embedded.draft_model) / "model.safetensors").is_file()
    for argv in (["--device", "cpu"], ["--model", "/models/x", "--device", "cuda:0"]):
        other = cli.parse_args(["serve-drafter", *argv])
        assert (other.drafter, other.draft_model) == ("ngram", None), argv
    # up: the drafter's own device decides
    gpu_drafter = cli.parse_args(["up", "--device", "cpu", "--drafter-device", "cuda:0"])
    assert gpu_drafter.drafter == "eagle3"
    cpu_drafter = cli.parse_args(["up", "--device", "cuda:1", "--drafter-device", "cpu"])
    assert cpu_drafter.drafter == "ngram"
    with pytest.raises(SystemExit):  # a head for another target must be named
        cli.parse_args(["serve-drafter", "--model", "/models/x", "--drafter", "eagle3"])


def test_supervise_restarts_a_dead_drafter_until_its_restarts_per_minute_are_used(
    tmp_path: Path,
) -> None:
    starts = tmp_path / "starts"
    crash = f"open({str(starts)!r}, 'a').write('x'); raise SystemExit(3)"

    async def main() -> None:
        services = up_services.Services(
            {
                "verifier": [sys.executable, "-c", "import time; time.sleep(60)"],
                "drafter": [sys.executable, "-c", crash],
            },
            restarts=up_services.RestartPolicy(max_per_minute=2, backoff_s=(0.1, 0.2)),
        )
        services.start()
        with pytest.raises(up_services.ServiceDied, match="drafter exited with 3 after 2 restarts"):
            await asyncio.wait_for(services.supervise(asyncio.sleep(60), asyncio.Event()), 30)
        assert starts.read_text() == "xxx"  # started, then restarted twice
        assert services.stop(10.0) == 1  # the drafter's exit code 3; the SIGTERM'd one is fine
        assert services.procs["verifier"].returncode == -15

    asyncio.run(main())


def test_supervise_stops_when_the_gateway_dies() -> None:
    async def main() -> None:
        services = up_services.Services(
            {
                "verifier": [sys.executable, "-c", "import time; time.sleep(60)"],
                "gateway": [sys.executable, "-c", "raise SystemExit(4)"],
            }
        )
        services.start()
        with pytest.raises(up_services.ServiceDied, match="gateway exited with 4"):
            await asyncio.wait_for(services.supervise(asyncio.sleep(60), asyncio.Event()), 30)
        assert services.stop(10.0) == 1

    asyncio.run(main())


def test_restart_policy_backs_off_and_forgets_restarts_older_than_a_minute() -> None:
    now = [0.0]
    policy = up_services.RestartPolicy(max_per_minute=3, backoff_s=(0.5, 1.0), clock=lambda: now[0])
    assert [policy.next_delay("drafter") for _ in range(4)] == [0.5, 1.0, 1.0, None]
    assert policy.next_delay("verifier") == 0.5  # counted per service
    now[0] = 61.0
    assert policy.next_delay("drafter") == 0.5


def test_supervise_returns_the_result_or_stops_on_interrupt() -> None:
    async def main() -> None:
        services = up_services.Services(
            {"verifier": [sys.executable, "-c", "import time; time.sleep(60)"]}
        )
        services.start()
        assert await services.supervise(asyncio.sleep(0.1, result=7), asyncio.Event()) == 7
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.1, stop.set)
        with pytest.raises(up_services.Interrupted):
            await services.supervise(asyncio.sleep(60), stop)
        assert services.stop(10.0) == 0

    asyncio.run(main())


def test_affinity_plan_gives_each_service_cores_of_its_own_from_the_top_or_none() -> None:
    names = ("verifier", "drafter", "gateway")
    assert affinity.affinity_plan(range(16), names) == {
        "verifier": {14, 15},
        "drafter": {12, 13},
        "gateway": {10, 11},
    }
    assert affinity.affinity_plan([0, 2, 4, 6, 8, 10, 12, 14], names) == {
        "verifier": {12, 14},
        "drafter": {8, 10},
        "gateway": {4, 6},
    }  # the cores up may use, whatever their numbers
    assert affinity.affinity_plan(range(7), names) == {}  # two left for the rest: 8 at least
    assert affinity.affinity_plan(range(2), names) == {}


def test_cpu_affinity_pins_only_when_asked_and_the_cores_are_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    pinned = {"verifier": {30, 31}, "drafter": {28, 29}, "gateway": {26, 27}}

    def plan(*argv: str) -> dict[str, set[int]]:
        return up.cpu_affinity(cli.parse_args(["up", *argv]))

    assert plan("--cpu-affinity", "on", "--device", "cpu") == pinned
    assert plan("--cpu-affinity", "off", "--device", "cuda:1", "--drafter-device", "cuda:0") == {}
    # off by default, on a GPU too: pinned and not ran alike there
    assert plan("--device", "cuda:1", "--drafter-device", "cuda:0") == {}
    assert plan("--device", "cuda", "--cpu-affinity", "on") == pinned
    assert plan("--device", "cpu") == {}
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert plan("--cpu-affinity", "on") == {}


def test_up_resolves_device_auto_before_it_picks_the_gpu_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    monkeypatch.setattr(up.os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = cli.parse_args(["up"])  # --device auto on a machine with a GPU
    up.resolve_devices(args)
    assert (args.device, args.drafter_device) == ("cuda", None)
    assert up.gateway_speculation_gate(args) == "on"
    assert up.gateway_lane_poll_ms(args) == up.LANE_POLL_MS_ON_GPU
    args = cli.parse_args(["up", "--drafter-device", "auto", "--device", "cpu"])
    up.resolve_devices(args)
    assert (args.device, args.drafter_device) == ("cpu", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli.parse_args(["up"])
    up.resolve_devices(args)
    assert args.device == "cpu"
    assert up.gateway_speculation_gate(args) == "on"


def test_up_hands_each_pinned_service_its_cores_and_they_parse_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    args = cli.parse_args(
        ["up", "--device", "cuda:1", "--drafter-device", "cuda:0", "--cpu-affinity", "on"]
    )
    children = {name: _child_args(argv) for name, argv in up.child_commands(args).items()}
    cores = {name: child.cpu_cores for name, child in children.items()}
    assert cores == {"verifier": {30, 31}, "drafter": {28, 29}, "gateway": {26, 27}}
    args = cli.parse_args(["up", "--device", "cuda:1", "--cpu-affinity", "off"])
    assert all(_child_args(argv).cpu_cores is None for argv in up.child_commands(args).values())
    assert cli.parse_args(["serve-verifier", "--cpu-cores", "3,5"]).cpu_cores == {3, 5}
    with pytest.raises(SystemExit):
        cli.parse_args(["serve-verifier", "--cpu-cores", "3,x"])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_pin_to_cores_pins_every_thread_of_the_process_and_those_started_after() -> None:
    core = max(os.sched_getaffinity(0))
    script = f"""
import os, threading
from specsplit.affinity import pin_to_cores
started = threading.Event()
done = threading.Event()
def wait():
    started.set()
    done.wait()
before = threading.Thread(target=wait)
before.start()
started.wait()
pin_to_cores({{{core}}})
after = threading.Thread(target=lambda: print(sorted(os.sched_getaffinity(0))))
after.start()
after.join()
print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(before.native_id)))
done.set()
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split("\n")
    assert out[:2] == [f"[{core}]", f"[{core}] [{core}]"]


def test_up_child_envs_on_cpu_calm_openmp_and_keep_user_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    envs = up.child_envs(cli.parse_args(["up", "--device", "cpu", "--drafter", "eagle3"]))
    assert envs == {
        "gateway": {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": up.CPU_SPINCOUNT},
        "drafter": {"GOMP_SPINCOUNT": up.CPU_SPINCOUNT},
        "verifier": {"GOMP_SPINCOUNT": up.CPU_SPINCOUNT},
    }
    ngram = up.child_envs(cli.parse_args(["up", "--device", "cpu", "--drafter", "ngram"]))
    assert ngram["drafter"] == {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": up.CPU_SPINCOUNT}
    cuda = up.child_envs(cli.parse_args(["up", "--device", "cuda", "--drafter", "ngram"]))
    assert cuda == {
        "gateway": {"OMP_NUM_THREADS": "1"},
        "drafter": {"OMP_NUM_THREADS": "1"},
        "verifier": {},
    }
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    kept = up.child_envs(cli.parse_args(["up", "--device", "cpu"]))
    assert all("GOMP_SPINCOUNT" not in env for env in kept.values())


def test_verifier_cuda_graph_and_kv_flags_reach_the_verifier_child() -> None:
    argv = ["up", "--cuda-graphs", "9,1,5", "--kv-memory-fraction", "0.5", "--kv-dtype", "float16"]
    verifier = _child_args(up.child_commands(cli.parse_args(argv))["verifier"])
    assert cli_flags.graph_query_lens(verifier) == (1, 5, 9)
    assert verifier.kv_memory_fraction == 0.5
    assert verifier.kv_dtype == "float16"
    assert cli.parse_args(["serve-verifier"]).kv_dtype == "auto"
    for refused in (["--device", "cuda"], ["--dtype", "bfloat16"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["up", "--kv-dtype", "float16", *refused])
    off = cli.parse_args(["serve-verifier", "--cuda-graphs", "none"])
    assert cli_flags.graph_query_lens(off) == ()
    assert cli_flags.graph_query_lens(cli.parse_args(["serve-verifier"])) == (1, 4, 5, 9, 17)
    with pytest.raises(SystemExit):
        cli_flags.graph_query_lens(cli.parse_args(["serve-verifier", "--cuda-graphs", "1,x"]))


def test_synthetic_acceptance_reaches_the_verifier_child_only() -> None:
    """The benchmark-only rates go to the verifier as given; off unless asked; the other
    children never see them."""
    argv = ["up", "--synthetic-acceptance", "0.8,0.7,0.6"]
    commands = up.child_commands(cli.parse_args(argv))
    assert _child_args(commands["verifier"]).synthetic_acceptance == (0.8, 0.7, 0.6)
    assert not any("--synthetic-acceptance" in commands[name] for name in ("drafter", "gateway"))
    default = up.child_commands(cli.parse_args(["up"]))["verifier"]
    assert "--synthetic-acceptance" not in default
    assert _child_args(default).synthetic_acceptance is None


@pytest.mark.parametrize("value", ["0.8,x", "1.5", "-0.1,0.5"])
def test_synthetic_acceptance_refuses_what_is_not_rates(value: str) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["serve-verifier", "--synthetic-acceptance", value])


def test_ahead_miss_reaches_the_gateway_child() -> None:
    def miss(*flags: str) -> str:
        child = up.child_commands(cli.parse_args(["up", *flags]))["gateway"]
        return _child_args(child).ahead_miss  # type: ignore[no-any-return]

    assert miss() == "plain"
    assert miss("--overlap", "ahead", "--ahead-miss", "draft") == "draft"
    with pytest.raises(SystemExit):
        cli.parse_args(["serve-gateway", "--ahead-miss", "skip"])


def test_overlap_flag_reaches_the_gateway_child(monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = _child_args(
        up.child_commands(cli.parse_args(["up", "--overlap", "groups"]))["gateway"]
    )
    assert gateway.overlap == "groups"
    argv = ["up", "--overlap", "both", "--ahead-guesses", "3", "--ahead-max-batch", "6"]
    both = _child_args(up.child_commands(cli.parse_args(argv))["gateway"])
    assert (both.overlap, both.ahead_guesses, both.ahead_max_batch) == ("both", 3, 6)
    assert cli.parse_args(["serve-gateway"]).overlap == "auto"  # serve_gateway: serial
    monkeypatch.setenv("SPECSPLIT_OVERLAP", "groups")
    assert cli.parse_args(["serve-gateway"]).overlap == "groups"


def test_up_has_the_gateway_poll_its_round_lanes_only_with_the_verifier_on_a_gpu() -> None:
    def poll_ms(*flags: str) -> float:
        child = up.child_commands(cli.parse_args(["up", *flags]))["gateway"]
        return _child_args(child).round_lane_poll_ms  # type: ignore[no-any-return]

    assert poll_ms("--device", "cuda:0") == up.LANE_POLL_MS_ON_GPU
    assert poll_ms("--device", "cpu") == 0.0  # polling takes a core from the CPU engines
    assert poll_ms("--device", "cpu", "--round-lane-poll-ms", "2") == 2.0
    assert poll_ms("--device", "cuda", "--round-lane-poll-ms", "0") == 0.0
    assert cli.parse_args(["serve-gateway"]).round_lane_poll_ms is None  # serve: 0
    assert _child_args(up.child_commands(cli.parse_args(["up"]))["gateway"]).round_lane == "on"


def test_a_drafter_or_verifier_polls_its_round_lane_between_rounds_on_a_gpu_only() -> None:
    """--idle-poll-ms: unless given, each service polls on a GPU and never on the CPU (its
    own device, resolved where it serves); `up` hands a given value to both engine services and
    leaves the default to each."""
    for argv in (["serve-drafter"], ["serve-verifier"], ["up"]):
        assert cli.parse_args(argv).idle_poll_ms is None
    assert cli_serve.idle_poll_ms(None, "cuda") == cli_flags.IDLE_POLL_MS_ON_GPU > 0
    assert cli_serve.idle_poll_ms(None, "cuda:1") == cli_flags.IDLE_POLL_MS_ON_GPU
    assert cli_serve.idle_poll_ms(None, "cpu") == 0.0  # the CPU engine needs the cores
    assert cli_serve.idle_poll_ms(0.0, "cuda:0") == 0.0
    assert cli_serve.idle_poll_ms(7.0, "cpu") == 7.0
    commands = up.child_commands(cli.parse_args(["up", "--idle-poll-ms", "7"]))
    for service in ("drafter", "verifier"):
        assert _child_args(commands[service]).idle_poll_ms == 7.0
    commands = up.child_commands(cli.parse_args(["up", "--device", "cuda:0"]))
    for service in ("drafter", "verifier"):
        assert _child_args(commands[service]).idle_poll_ms is None  # each service's default


def test_up_overlaps_by_default_only_with_the_drafter_and_verifier_on_two_gpus() -> None:
    def overlap(*flags: str) -> str:
        child = up.child_commands(cli.parse_args(["up", *flags]))["gateway"]
        return _child_args(child).overlap  # type: ignore[no-any-return]

    # two GPUs: groups or serial rounds, measured (groups lose where a half-batch Verify costs
    # what a whole one does)
    assert overlap("--device", "cuda:1", "--drafter-device", "cuda:0") == "gated"
    assert overlap("--device", "cuda") == "serial"  # one GPU: the groups contend for it
    assert overlap("--device", "cuda:0", "--drafter-device", "cuda:0") == "serial"
    assert overlap("--device", "cpu") == "serial"
    assert overlap("--device", "cuda:1", "--drafter-device", "cpu") == "serial"
    two_gpus = ("--device", "cuda:1", "--drafter-device", "cuda:0")
    assert overlap(*two_gpus, "--drafter", "ngram") == "serial"  # no drafter GPU work to hide
    assert overlap(*two_gpus, "--overlap", "serial") == "serial"
    assert overlap("--device", "cpu", "--overlap", "groups") == "groups"
    assert overlap(*two_gpus, "--overlap", "groups") == "groups"


def test_up_sends_groups_early_verifies_by_default_only_with_the_drafter_and_verifier_on_two_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--early-verify auto: on with two GPUs (the Verify queued on the verifier's GPU behind
    the round in flight), off on one GPU or the CPU (the groups contend for it) and with serial
    rounds; serve-gateway cannot see the devices: off unless asked (the GPU compose file asks)."""

    def early(*flags: str) -> bool:
        child = up.child_commands(cli.parse_args(["up", *flags]))["gateway"]
        return _child_args(child).early_verify  # type: ignore[no-any-return]

    two_gpus = ("--device", "cuda:1", "--drafter-device", "cuda:0")
    assert early(*two_gpus) is True
    assert early(*two_gpus, "--overlap", "groups") is True
    assert early(*two_gpus, "--overlap", "serial") is False
    assert early(*two_gpus, "--no-early-verify") is False
    assert early("--device", "cuda") is False
    assert early("--device", "cpu") is False
    assert early("--device", "cpu", "--overlap", "groups", "--early-verify") is True
    assert cli.parse_args(["serve-gateway"]).early_verify is None  # serve_gateway: off
    monkeypatch.setenv("SPECSPLIT_EARLY_VERIFY", "on")
    assert cli.parse_args(["serve-gateway"]).early_verify is True
    compose = (Path(__file__).parents[2] / "docker-compose.yml").read_text()
    assert "SPECSPLIT_EARLY_VERIFY: ${SPECSPLIT_EARLY_VERIFY:-on}" in compose


def test_drafter_kv_share_is_small_only_when_up_puts_it_on_the_verifiers_gpu() -> None:
    def drafter_fraction(*flags: str) -> float | None:
        child = up.child_commands(cli.parse_args(["up", *flags]))["drafter"]
        return _child_args(child).draft_kv_memory_fraction  # type: ignore[no-any-return]

    shared = cli_flags.SHARED_DRAFTER_KV_MEMORY_FRACTION
    assert drafter_fraction("--device", "cuda") == shared
    assert drafter_fraction("--device", "cuda:1", "--drafter-device", "cuda:1") == shared
    assert drafter_fraction("--device", "cuda:1", "--drafter-device", "cuda:0") is None
    assert drafter_fraction("--device", "cpu") is None
    assert drafter_fraction("--device", "cuda", "--draft-kv-memory-fraction", "0.3") == 0.3
    # alone (compose: a GPU of its own) the drafter takes the default share
    assert cli.parse_args(["serve-drafter"]).draft_kv_memory_fraction is None


def test_up_gates_speculation_by_default_on_every_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """auto: on with the verifier on a GPU or on the CPU (speculation may lose to the target on
    either); serve-gateway: off unless asked."""

    def gate(*flags: str) -> str:
        child = up.child_commands(cli.parse_args(["up", *flags]))["gateway"]
        return _child_args(child).speculation_gate  # type: ignore[no-any-return]

    assert gate("--device", "cuda:1", "--drafter-device", "cuda:0") == "on"
    assert gate("--device", "cuda") == "on"
    assert gate("--device", "cpu") == "on"
    assert gate("--device", "cuda", "--speculation-gate", "off") == "off"
    assert gate("--device", "cpu", "--speculation-gate", "off") == "off"
    assert cli.parse_args(["serve-gateway"]).speculation_gate == "auto"  # serve_gateway: off
    monkeypatch.setenv("SPECSPLIT_SPECULATION_GATE", "on")
    assert cli.parse_args(["serve-gateway"]).speculation_gate == "on"


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "native"),
    [(True, False, True), (False, True, True), (False, False, False), (None, None, False)],
)
def test_a_cpu_multiplies_bf16_natively_with_amx_or_avx512_bf16(
    monkeypatch: pytest.MonkeyPatch, amx: bool | None, avx512_bf16: bool | None, native: bool
) -> None:
    """The CPU check behind the verifier's hint that --dtype bfloat16 runs faster there (None:
    a torch without that check)."""
    import torch

    from specsplit.cli_serve import cpu_has_bf16

    for name, present in (
        ("_is_amx_tile_supported", amx),
        ("_is_avx512_bf16_supported", avx512_bf16),
    ):
        if present is None:
            monkeypatch.delattr(torch.cpu, name, raising=False)
        else:
            monkeypatch.setattr(torch.cpu, name, lambda present=present: present)
    assert cpu_has_bf16() is native


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        ([], 64),  # graphs up to the default, above the gateway's 32
        (["--max-batch-size", "128"], 128),  # every batch the gateway may send
        (["--max-batch-size", "8", "--graph-max-batch", "96"], 96),
    ],
)
def test_up_captures_graphs_for_every_batch_the_gateway_may_send(
    argv: list[str], want: int
) -> None:
    """A round larger than the services' graphs runs eagerly (host-bound on a GPU): `up`
    passes both of them the larger of --graph-max-batch and the gateway's --max-batch-size."""
    commands = up.child_commands(cli.parse_args(["up", *argv]))
    for name in ("verifier", "drafter"):
        assert _child_args(commands[name]).graph_max_batch == want


@pytest.mark.parametrize("value", ["0", "257", "x"])
def test_graph_max_batch_is_between_1_and_256(value: str) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["serve-verifier", "--graph-max-batch", value])


def test_serve_commands_hand_the_graphs_largest_batch_to_their_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """serve-verifier and serve-drafter pass --graph-max-batch on (the engines' max_batch_size)."""
    import drafter.main
    import verifier.main
    from specsplit import cli_serve

    seen: dict[str, int] = {}

    async def fake_serve(name: str, *args: object, graph_max_batch: int, **kwargs: object) -> None:
        seen[name] = graph_max_batch

    monkeypatch.setattr(verifier.main, "serve", partial(fake_serve, "verifier"))
    monkeypatch.setattr(drafter.main, "serve", partial(fake_serve, "drafter"))
    cli_serve.serve_verifier(cli.parse_args(["serve-verifier", "--graph-max-batch", "96"]))
    cli_serve.serve_drafter(cli.parse_args(["serve-drafter", "--graph-max-batch", "128"]))
    assert seen == {"verifier": 96, "drafter": 128}


@pytest.mark.parametrize(
    ("largest", "buckets"),
    [
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
        (128, [1, 2, 4, 8, 16, 32, 48, 64, 96, 128]),
        (100, [1, 2, 4, 8, 16, 32, 48, 64, 96, 100]),
        (8, [1, 2, 4, 8]),
    ],
)
def test_graphs_past_64_take_buckets_of_96_and_up(largest: int, buckets: list[int]) -> None:
    """A batch of 65 pads to 96, not to the largest batch (the verifier's and the drafter's
    graphs alike)."""
    from specsplit.model.cuda_graphs import batch_buckets

    assert batch_buckets(largest) == buckets


@pytest.mark.parametrize(
    ("version_py", "for_a_gpu"),
    [
        ("cuda: Optional[str] = None\nhip: Optional[str] = None\n", False),
        ("cuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n", True),
        ("cuda = None\nhip = '6.4.43482'\n", True),
        ("cuda = None\n", True),  # (a file that does not say: ask torch)
        ("cuda = None\nhip = None\n", False),
        (None, True),  # no file
    ],
)
def test_up_reads_whether_torch_is_built_for_a_gpu_without_importing_it(
    version_py: str | None, for_a_gpu: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "torch").mkdir()
    if version_py is not None:
        (tmp_path / "torch" / "version.py").write_text(version_py)
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path / "torch")]
    monkeypatch.setattr(up.importlib.util, "find_spec", lambda name: spec)
    assert up._torch_built_for_a_gpu() is for_a_gpu


def test_up_parses_and_resolves_auto_on_a_cpu_torch_without_importing_it() -> None:
    """`up` starts its children before it imports torch (~1 s on a 2-core VM): its flags'
    checks (the default draft shape, the adaptive ladder) and --device auto need none."""
    code = (
        "import sys; from specsplit import cli, up; args = cli.parse_args(['up']); "
        "up.resolve_devices(args); print(args.device, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import torch

    if torch.version.cuda or torch.version.hip:
        assert out.stdout.split()[1] == "True"  # a GPU build is asked
    else:
        assert out.stdout.split() == ["cpu", "False"]
