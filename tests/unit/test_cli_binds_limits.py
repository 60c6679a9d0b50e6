"""Command-line defaults that keep a fresh install private and bounded: every listener on
127.0.0.1 unless told otherwise (--host / SPECSPLIT_HOST, or a full address), the gateway's
request limits as flags and env, `up`'s CPU children calmed with --device auto too, and no
progress bars from the services."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specsplit import cli, cli_server_flags, up


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SPECSPLIT_"):
            monkeypatch.delenv(name)


def _hosts(args) -> set[str]:
    addresses = [args.listen, args.metrics_listen, getattr(args, "http_listen", None)]
    return {a.rsplit(":", 1)[0] for a in addresses if a is not None}


def _child(argv: list[str]):
    assert argv[:3] == [sys.executable, "-m", "specsplit.cli"]
    return cli.parse_args(argv[3:])


@pytest.mark.parametrize("command", ["serve-drafter", "serve-verifier", "serve-gateway"])
def test_every_listener_binds_loopback_by_default(command: str) -> None:
    args = cli.parse_args([command])
    assert _hosts(args) == {"127.0.0.1"}
    port = cli_server_flags.METRICS_PORTS[command.removeprefix("serve-")]
    assert args.metrics_listen == f"127.0.0.1:{port}"


def test_up_children_bind_loopback_by_default() -> None:
    for name, argv in up.child_commands(cli.parse_args(["up"])).items():
        child = _child(argv)
        assert _hosts(child) == {"127.0.0.1"}, (name, argv)
    gateway = _child(up.child_commands(cli.parse_args(["up"]))["gateway"])
    assert gateway.http_listen == "127.0.0.1:8000"


def test_host_flag_and_env_open_every_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _hosts(cli.parse_args(["serve-gateway", "--host", "0.0.0.0"])) == {"0.0.0.0"}
    args = cli.parse_args(["serve-gateway", "--host", "::"])
    assert (args.listen, args.http_listen) == ("[::]:50051", "[::]:8000")
    # a full address wins over --host; "none" still turns a listener off
    args = cli.parse_args(["serve-gateway", "--host", "0.0.0.0", "--listen", "10.0.0.1:7"])
    assert (args.listen, args.metrics_listen) == ("10.0.0.1:7", "0.0.0.0:9400")
    assert cli.parse_args(["serve-gateway", "--http-listen", "none"]).http_listen is None
    monkeypatch.setenv("SPECSPLIT_HOST", "0.0.0.0")
    assert _hosts(cli.parse_args(["serve-drafter"])) == {"0.0.0.0"}
    for argv in up.child_commands(cli.parse_args(["up"])).values():
        assert _hosts(_child(argv)) == {"0.0.0.0"}


def test_request_limit_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = cli_server_flags.request_limits(cli.parse_args(["serve-gateway"]))
    assert (limits.max_num_steps, limits.max_topk, limits.max_num_draft_tokens) == (16, 8, 64)
    assert (limits.max_new_tokens, limits.max_prompt_bytes) == (4096, None)
    assert limits.max_message_bytes == 4 * 1024 * 1024
    monkeypatch.setenv("SPECSPLIT_LIMIT_NUM_STEPS", "4")
    monkeypatch.setenv("SPECSPLIT_LIMIT_PROMPT_BYTES", "1000")
    monkeypatch.setenv("SPECSPLIT_MAX_WAITING", "3")
    args = cli.parse_args(["serve-gateway", "--limit-new-tokens", "100"])
    limits = cli_server_flags.request_limits(args)
    assert (limits.max_num_steps, limits.max_prompt_bytes, limits.max_new_tokens) == (4, 1000, 100)
    assert args.max_waiting == 3
    # `up` hands them to its gateway
    gateway = _child(up.child_commands(cli.parse_args(["up", "--limit-topk", "2"]))["gateway"])
    assert cli_server_flags.request_limits(gateway) == cli_server_flags.request_limits(
        cli.parse_args(["serve-gateway", "--limit-topk", "2"])
    )
    assert gateway.max_waiting == 3


def test_a_default_shape_over_the_limits_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["serve-gateway", "--num-steps", "8", "--limit-num-steps", "4"])
    assert "over --limit-num-steps 4" in capsys.readouterr().err


def test_up_with_device_auto_on_a_cpu_gives_children_the_gomp_spincount(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    for name in ("GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    envs = up.child_envs(cli.parse_args(["up"]))  # --device auto
    assert all(env.get("GOMP_SPINCOUNT") == up.CPU_SPINCOUNT for env in envs.values()), envs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    envs = up.child_envs(cli.parse_args(["up"]))
    assert all("GOMP_SPINCOUNT" not in env for env in envs.values()), envs


def test_services_draw_no_progress_bars() -> None:
    """Two services of `up` loading at once drew their tqdm bars (transformers' GGUF
    conversion) over each other on one terminal line."""
    script = (
        "import sys\n"
        "from specsplit import cli\n"
        "def fake_service(args):\n"
        "    from tqdm.auto import tqdm\n"
        "    for _ in tqdm(range(3), desc='LOADING-BAR'): pass\n"
        "    return 0\n"
        "cli.COMMANDS['serve-verifier'] = fake_service\n"
        "sys.exit(cli.main(['serve-verifier', '--metrics-listen', 'none']))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TQDM_", "OTEL_"))}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "LOADING-BAR" not in done.stderr + done.stdout


def test_compose_binds_every_interface_inside_and_publishes_on_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.unit.test_compose import COMPOSE, SPECSPLIT_SERVICES, load, parsed, plain

    base = plain(load(COMPOSE))
    for name in SPECSPLIT_SERVICES:  # the others reach them over the compose network
        # the drafter and the verifier serve rounds on Unix sockets in a volume only the
        # gateway shares (test_compose); every TCP listener binds every interface inside
        hosts = _hosts(parsed(base, name, monkeypatch)) - {"unix"}
        assert hosts == {"0.0.0.0"}, name
    for name, service in base["services"].items():
        for item in service.get("ports", []):
            assert str(item).startswith("127.0.0.1:"), (name, item)
