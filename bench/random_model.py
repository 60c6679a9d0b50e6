"""Write a random-weight checkpoint shaped like SmolLM2-135M (for speed runs where the real
weights cannot travel), with a tokenizer copied from a saved tokenizer directory.

    python bench/random_model.py OUT_DIR --tokenizer TOKENIZER_DIR
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--tokenizer", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(args.out)
    AutoTokenizer.from_pretrained(args.tokenizer).save_pretrained(args.out)


if __name__ == "__main__":
    main()
