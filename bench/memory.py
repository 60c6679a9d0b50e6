"""Peak GPU memory per service and the largest batch that fits, with the KV pools sized as the
services size them (`VerifierEngine.for_model`, `ModelProposer.for_model`: a share of the memory
free after the weights), random weights of the named shapes.

For each service: the weights, the KV pool (pages, tokens), memory after warm-up (CUDA graphs
captured), the device's own count of what the process holds (`mem_get_info`: the CUDA context,
cached blocks and graph pools included). Then the largest batch whose sequences all fit at
--context tokens (the smaller of the two pools decides), and, for each --batch (capped there), a
real run through the scheduler: that many requests of --context tokens admitted at once (their
prefills in one Verify and one Draft: the worst case a round can bring), decoding
--max-new-tokens with chain-3 drafts, with each device's peak allocation in the run.

    PYTHONPATH=. python bench/memory.py --target llama-8b --draft llama-1b --device cuda:1 \
        --drafter-device cuda:0 --context 2048 --batch 8 32 64
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer

from bench.gpu_e2e import VOCAB, random_model, run
from bench.gpu_engine import SHAPES
from drafter.engine import DrafterEngine
from drafter.model_proposer import ModelProposer
from drafter.tree_draft import CATCH_UP_LENS
from gateway.request import GenerationRequest
from gateway.scheduler import Scheduler
from inprocess.clients import LocalDrafterClient, LocalVerifierClient
from specsplit.cli_flags import DRAFTER_KV_MEMORY_FRACTION, SHARED_DRAFTER_KV_MEMORY_FRACTION
from specsplit.kv_cache import KVCache
from specsplit.messages import SpecParams
from verifier.engine import VerifierEngine
from verifier.warmup import GRAPH_QUERY_LENS

GIB = 2**30


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def held(device: torch.device) -> int:
    """Bytes in use on the device (all of it: context, caches, other processes)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def pool_bytes(kv: KVCache) -> int:
    return kv.data.numel() * kv.data.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--draft", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--device", default="cuda:0", help="the verifier's")
    parser.add_argument("--drafter-device", default=None, help="default: --device")
    parser.add_argument("--kv-memory-fraction", type=float, default=0.8)
    parser.add_argument("--draft-kv-memory-fraction", type=float, default=None)
    parser.add_argument("--context", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--tokenizer", default=".gpu/tokenizer")
    args = parser.parse_args()
    device = torch.device(args.device)
    draft_device = torch.device(args.drafter_device or args.device)
    shared = draft_device == device
    draft_fraction = args.draft_kv_memory_fraction or (
        SHARED_DRAFTER_KV_MEMORY_FRACTION if shared else DRAFTER_KV_MEMORY_FRACTION
    )
    dtype = torch.bfloat16
    max_batch = max(args.batch)

    rows: list[tuple[str, str, str]] = []  # (service, what, value)
    target = random_model(args.target, str(device), dtype, seed=0)
    verifier = VerifierEngine.for_model(
        target,
        kv_memory_fraction=args.kv_memory_fraction,
        graph_query_lens=GRAPH_QUERY_LENS,
        max_batch_size=64,
    )
    verifier.warmup()
    draft = random_model(args.draft, str(draft_device), dtype, seed=1)
    proposer = ModelProposer.for_model(draft, None, 16, draft_fraction)
    drafter = DrafterEngine(proposer, graph_catch_up_lens=CATCH_UP_LENS, max_batch_size=64)
    drafter.warmup()
    torch.cuda.synchronize()
    pools = {"verifier": verifier.kv, "drafter": proposer.kv}
    for name, model, kv, dev in (
        ("verifier", target, verifier.kv, device),
        ("drafter", draft, proposer.kv, draft_device),
    ):
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        rows.append((name, "weights GiB", gib(weights)))
        tokens = kv.allocator.num_pages * kv.page_size
        rows.append((name, "KV pool GiB (tokens)", f"{gib(pool_bytes(kv))} ({tokens})"))
        if not shared or name == "verifier":
            rows.append(
                (name, "allocated after warm-up GiB", gib(torch.cuda.memory_allocated(dev)))
            )
            rows.append((name, "reserved after warm-up GiB", gib(torch.cuda.memory_reserved(dev))))
            total = torch.cuda.get_device_properties(dev).total_memory
            rows.append((name, "device memory in use GiB (of)", f"{gib(held(dev))} ({gib(total)})"))
    pages_per_seq = -(-args.context // 16) + 2  # the context and a round's draft tokens
    fits = {name: kv.allocator.num_pages // pages_per_seq for name, kv in pools.items()}
    largest = min(fits.values())
    print(
        f"{args.target} target on {device}, {args.draft} draft on {draft_device}, bf16, random "
        f"weights; KV shares {args.kv_memory_fraction} / {draft_fraction}"
    )
    print("| service | what | value |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(
        f"largest batch at {args.context} tokens per sequence: {largest} (the verifier's pool "
        f"holds {fits['verifier']}, the drafter's {fits['drafter']})"
    )

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    gen = torch.Generator().manual_seed(0)
    prompt_len = args.context - args.max_new_tokens - 8
    print(
        "| batch | verifier peak allocated GiB | drafter peak allocated GiB | tokens/s |\n"
        "|---|---|---|---|"
    )
    for batch in sorted({min(b, largest) for b in args.batch}):
        prompts = [
            torch.randint(3, VOCAB, (prompt_len,), generator=gen).tolist() for _ in range(batch)
        ]
        requests = [GenerationRequest(p, args.max_new_tokens, ignore_eos=True) for p in prompts]
        scheduler = Scheduler(
            LocalDrafterClient(drafter),
            LocalVerifierClient(verifier),
            tokenizer,
            eos_token_ids=(),
            default_spec=SpecParams(3, 1, 3),
            max_batch_size=max_batch,
        )
        for dev in {device, draft_device}:
            torch.cuda.reset_peak_memory_stats(dev)
        tokens, seconds, _ = run(scheduler, requests)
        peaks = [gib(torch.cuda.max_memory_allocated(d)) for d in (device, draft_device)]
        if shared:
            peaks[1] = "(same device)"
        print(
            f"| {batch} | {peaks[0]} | {peaks[1]} | {tokens / seconds:.1f} |",
            flush=True,
        )
        assert verifier.num_pages_used == 0 and drafter.num_pages_used == 0


if __name__ == "__main__":
    main()
