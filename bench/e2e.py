"""End-to-end tokens/s: `specsplit up` (three processes) with speculation vs the same services with
speculation off (target only), vs HF transformers `generate` (plain and prompt lookup), one run.

Each prompt of the bundled set is generated alone (one stream at a time, greedy), as a chat user
would. The services run first; HF runs after they have stopped, so nothing competes for cores.

    PYTHONPATH=. python bench/e2e.py --max-new-tokens 64 [--model PATH] [--device cuda]
        [--drafter KIND] [--spec 5 5x2x8 ...] [--assistant-layers 8]

--spec takes draft shapes STEPS[xTOPK[xNODES]] sent per request (default: the gateway's default
shape); each is one row. HF assisted generation uses a copy of the target cut to its first
--assistant-layers layers as `assistant_model` (there is no smaller SmolLM2 to use).
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import subprocess
import sys
import time

import grpc
import torch
from transformers import AutoModelForCausalLM

from bench.acceptance import bundled_prompts
from gateway.adaptive import format_ladder, parse_ladder
from gateway.text import apply_chat_template
from specsplit import convert
from specsplit.model.loader import (
    embedded_default_model_path,
    from_pretrained_args,
    load_tokenizer,
)
from specsplit.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


def wait_gateway(address: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"specsplit up exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError("gateway not serving")


def run_services(
    args: argparse.Namespace, prompts: list[list[int]]
) -> dict[str, tuple[float, int, float, list[list[int]]]]:
    port = 50151
    cmd = [
        sys.executable,
        "-m",
        "specsplit.cli",
        "up",
        "--gateway-port",
        str(port),
        "--drafter-port",
        "50161",
        "--verifier-port",
        "50162",
        "--device",
        args.device,
    ]
    if args.model:
        cmd += ["--model", args.model]
    if args.drafter:
        cmd += ["--drafter", args.drafter] + (
            ["--draft-model", args.draft_model] * bool(args.draft_model)
        )
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = {}
    try:
        address = f"127.0.0.1:{port}"
        wait_gateway(address, proc, 900)
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))
        specs: dict[str, common_pb2.SpecParams | None] = {}
        for shape in parse_ladder(",".join(args.spec)) if args.spec else [None]:
            label = "default shape" if shape is None else format_ladder([shape])
            specs[f"specsplit {label}"] = shape and convert.spec_to_proto(shape)
        specs["specsplit target only"] = common_pb2.SpecParams(num_steps=0, topk=1)
        for prompt in prompts[:2]:  # warm-up
            list(
                stub.Generate(
                    gateway_pb2.GenerateRequest(
                        token_ids=gateway_pb2.TokenIds(ids=prompt), max_new_tokens=8
                    )
                )
            )
        for name, spec in specs.items():
            outputs, rounds, accepted = [], 0, 0
            start = time.perf_counter()
            for prompt in prompts:
                responses = list(
                    stub.Generate(
                        gateway_pb2.GenerateRequest(
                            token_ids=gateway_pb2.TokenIds(ids=prompt),
                            max_new_tokens=args.max_new_tokens,
                            spec=spec,
                        )
                    )
                )
                outputs.append([t for r in responses for t in r.token_ids])
                rounds += responses[-1].spec_stats.rounds
                accepted += (
                    responses[-1].spec_stats.num_accepted_drafts + responses[-1].spec_stats.rounds
                )
            seconds = time.perf_counter() - start
            results[name] = (seconds, sum(map(len, outputs)), accepted / max(rounds, 1), outputs)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    return results


def run_hf(
    args: argparse.Namespace, prompts: list[list[int]], path: str
) -> dict[str, tuple[float, int, float, list[list[int]]]]:
    name, kwargs = from_pretrained_args(path)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs).to(args.device)
    results = {}
    variants: dict[str, dict[str, object]] = {
        "HF generate": {},
        "HF generate prompt_lookup 3": {"prompt_lookup_num_tokens": 3},
    }
    if args.assistant_layers:
        assistant = copy.deepcopy(model)
        assistant.model.layers = assistant.model.layers[: args.assistant_layers]
        assistant.config.num_hidden_layers = args.assistant_layers
        variants[f"HF assisted (first {args.assistant_layers} layers)"] = {
            "assistant_model": assistant
        }
    for label, extra in variants.items():
        model.generate(
            torch.tensor([prompts[0]], device=args.device),
            max_new_tokens=8,
            do_sample=False,
            **extra,
        )
        outputs = []
        start = time.perf_counter()
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt], device=args.device),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                **extra,
            )
            outputs.append(out[0, len(prompt) :].tolist())
        seconds = time.perf_counter() - start
        results[label] = (seconds, sum(map(len, outputs)), float("nan"), outputs)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--drafter", default=None, help="specsplit up --drafter (default: its own)")
    parser.add_argument("--draft-model", default=None)
    parser.add_argument("--spec", nargs="*", default=None, help="draft shapes, one row each")
    parser.add_argument("--assistant-layers", type=int, default=8, help="0 = no assisted row")
    args = parser.parse_args()
    path = args.model or embedded_default_model_path()
    tokenizer = load_tokenizer(path)
    prompts = [apply_chat_template(tokenizer, m) for m in bundled_prompts()][: args.num_prompts]

    results = run_services(args, prompts)
    results.update(run_hf(args, prompts, path))
    reference = results["specsplit target only"][3]
    base = {k: results[k][1] / results[k][0] for k in ("specsplit target only", "HF generate")}
    print(
        f"model {path}; {len(prompts)} prompts one at a time, greedy, max_new_tokens "
        f"{args.max_new_tokens}, device {args.device}, {os.cpu_count()} CPUs"
    )
    print(
        f"{'run':<30}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'acc/round':>10}"
        f"{'vs target-only':>16}{'vs HF':>8}  same tokens as target-only"
    )
    for name, (seconds, tokens, acc, outputs) in results.items():
        tps = tokens / seconds
        same = sum(o == r for o, r in zip(outputs, reference, strict=True))
        print(
            f"{name:<30}{tokens:>8}{seconds:>9.2f}{tps:>10.1f}{acc:>10.2f}"
            f"{tps / base['specsplit target only']:>15.2f}x{tps / base['HF generate']:>7.2f}x"
            f"  {same}/{len(outputs)}"
        )


if __name__ == "__main__":
    main()
