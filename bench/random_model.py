"""Write a random-weight checkpoint (for speed runs where real weights cannot travel), with a
tokenizer copied from a saved tokenizer directory.

    python bench/random_model.py OUT_DIR --tokenizer TOKENIZER_DIR [--shape llama-8b]
        [--device cuda:0]

--shape: one of bench/gpu_engine.py's shapes (default SmolLM2-135M), its vocabulary cut to the
tokenizer's so that the services can turn every token into text (an 8B shape with SmolLM2's
49,152 tokens: a 0.4 GB LM head instead of Llama 3's 1.05 GB, ~5% of the 8B's weight bytes).
The weights are drawn on --device (an 8B checkpoint in seconds on a GPU, minutes on a CPU) and
saved in --dtype.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench.gpu_engine import SHAPES

COMMON = {  # every shape's config beside its sizes
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--device", default="cpu", help="where the weights are drawn")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    sizes = dict(SHAPES[args.shape])
    sizes["vocab_size"] = min(int(sizes["vocab_size"]), len(tokenizer))
    config = LlamaConfig(**sizes, **COMMON)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)


if __name__ == "__main__":
    main()
