"""What loading a GGUF target onto a GPU costs, its tensors dequantized by gguf's numpy on the host
and then moved, against moved as their stored bytes and dequantized on the GPU
(`GGUFFile.tensor`, specsplit/model/gguf_dequant.py), in one process.

A random GGUF of a bench shape (bench/gpu_engine.py's SHAPES) with its matrices in one format
(random blocks with small finite scales, tests/unit/test_gguf_dequant.py's: the values do not
matter here) is written to --path
unless there; then `load_model`'s GGUF steps timed each way, alternating, `--repeat` times: the
state dict read (`GGUFStateDict` on the host or on the device) and `state_dict_from_hf` casting
and moving it (the file read once into the page cache and loaded once untimed first: a
process's first load paid ~5 s more on the CPU VM, fresh memory's page faults).

    PYTHONPATH=. python bench/gguf_load.py [--shape llama-8b] [--qtype Q4_K] [--path FILE]
        [--device cuda] [--repeat 2]

`--shape tiny --device cpu` checks the script alone (both ways are then gguf's numpy).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from bench.gpu_engine import SHAPES
from specsplit.model.gguf_file import GGUFFile, GGUFStateDict, model_config
from specsplit.model.llama import state_dict_from_hf
from tests.unit.test_gguf_dequant import SCALES, random_rows


def write_gguf(path: str, shape: str, qtype: GGMLQuantizationType) -> None:
    """A random `llama` GGUF of `shape`, its matrices in `qtype` (each kind's bytes made once and
    reused: the time goes to reading them), norms in F32."""
    sizes = SHAPES[shape]
    hidden, ffn = int(sizes["hidden_size"]), int(sizes["intermediate_size"])
    heads, kv_heads = int(sizes["num_attention_heads"]), int(sizes["num_key_value_heads"])
    vocab, layers = int(sizes["vocab_size"]), int(sizes["num_hidden_layers"])
    head_dim = hidden // heads
    writer = GGUFWriter(path, "llama")
    writer.add_name(f"random-{shape}")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(sizes["rope_theta"]))
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    made: dict[tuple[int, int], np.ndarray] = {}

    def matrix(name: str, rows: int, cols: int) -> None:
        if (rows, cols) not in made:
            made[rows, cols] = random_rows(qtype, rows, cols // GGML_QUANT_SIZES[qtype][0], 0)
        writer.add_tensor(name, made[rows, cols], raw_dtype=qtype)

    ones = np.ones(hidden, dtype=np.float32)
    matrix("token_embd.weight", vocab, hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        matrix(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.add_tensor("output_norm.weight", ones)
    if not sizes["tie_word_embeddings"]:
        matrix("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_seconds(path: str, device: str, dequantize_on: str) -> float:
    """`load_model`'s GGUF steps onto `device`, the tensors dequantized on `dequantize_on`."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    start = time.perf_counter()
    with GGUFFile(path) as file:
        config = model_config(file)
        weights = GGUFStateDict(file, config.num_heads, config.num_kv_heads, dequantize_on)
        state_dict = state_dict_from_hf(config, weights, torch.bfloat16, device)
    sync()
    seconds = time.perf_counter() - start
    del state_dict
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--qtype", choices=[q.name for q in SCALES], default="Q4_K")
    parser.add_argument("--path", help="default: /tmp/random-SHAPE-QTYPE.gguf")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    qtype = GGMLQuantizationType[args.qtype]
    sizes = SHAPES[args.shape]
    block = GGML_QUANT_SIZES[qtype][0]
    if int(sizes["hidden_size"]) % block or int(sizes["intermediate_size"]) % block:
        parser.error(f"{args.shape}'s widths are not whole {args.qtype} blocks of {block}")
    path = args.path or f"/tmp/random-{args.shape}-{args.qtype}.gguf"
    if not os.path.exists(path):
        start = time.perf_counter()
        write_gguf(path, args.shape, qtype)
        print(f"wrote {path}: {os.path.getsize(path) / 2**30:.2f} GiB in "
              f"{time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    with open(path, "rb") as file:  # into the page cache first: every timed read alike
        while file.read(1 << 26):
            pass
    load_seconds(path, args.device, args.device)  # untimed: the process's first allocations
    times: dict[str, list[float]] = {"host": [], args.device: []}
    for _ in range(args.repeat):
        for where in times:
            on = "cpu" if where == "host" else where
            times[where].append(load_seconds(path, args.device, on))
    print(f"{args.shape} {args.qtype} onto {args.device}, {args.repeat} each, alternating:")
    for where, seconds in times.items():
        runs = " / ".join(f"{s:.2f}" for s in seconds)
        print(f"  dequantized on {where}: {runs} s (median {statistics.median(seconds):.2f})")


if __name__ == "__main__":
    main()
