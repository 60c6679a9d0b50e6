"""Write a random-weight checkpoint (for speed runs where real weights cannot travel), with a
tokenizer copied from a saved tokenizer directory, and optionally a random EAGLE-3 head for it.

    python bench/random_model.py OUT_DIR --tokenizer TOKENIZER_DIR [--shape llama-8b]
        [--device cuda:0] [--eagle3-head HEAD_DIR [--draft-vocab 32000]]
        [--mirror-draft DRAFT_DIR [--mirror-layers 1]] [--logit-scale 8]

--shape: one of bench/gpu_engine.py's shapes (default SmolLM2-135M), its vocabulary cut to the
tokenizer's so that the services can turn every token into text (an 8B shape with SmolLM2's
49,152 tokens: a 0.4 GB LM head instead of Llama 3's 1.05 GB, ~5% of the 8B's weight bytes).
The weights are drawn on --device (an 8B checkpoint in seconds on a GPU, minutes on a CPU) and
saved in --dtype. --eagle3-head: a head shaped like the public EAGLE-3 heads for Llama-3.1-8B
(one decoder layer of the target's width, heads and MLP; --draft-vocab tokens mapped to a random
subset of the target's; the target's embedding), in the published layout
(drafter/eagle_checkpoint.py), for `--drafter eagle3 --draft-model HEAD_DIR`.

--mirror-draft (timing only, labelled where used): the target's layers past the first
--mirror-layers add nothing (their attention output and MLP down projections are zero, so each
passes its input on unchanged, bit for bit, at the full layer's cost), and DRAFT_DIR gets a draft
model of those first layers with the target's embedding, norm and LM head: its greedy tokens are
the target's (but where bfloat16 rounds a near-tie differently in another batch shape). So a
random 8B-shaped target runs at its own cost while the draft predicts it: draft-ahead's guesses
hit as with a real draft, which no random pair does (`bench/profile_services.py --drafter model
--draft-model DRAFT_DIR --overlap ahead`, with `--synthetic-acceptance` for its accept lengths).

--logit-scale S (timing only): the final norm's weight times S, so the logits are S times
sharper (the draft's too, which shares that norm). A random model's next-token distribution at
temperature 1 is nearly flat over the vocabulary (no sampled bonus token is ever guessed);
scaled, its likeliest token carries most of the mass, as a trained model's often does, and
sampled draft-ahead's bonus guesses can hit. The script prints the top token's probability
(temperature 1) over random contexts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench.gpu_engine import SHAPES
from drafter.eagle_checkpoint import HEAD_LAYER, HEAD_WEIGHTS, Eagle3Config
from specsplit.model.config import ModelConfig

COMMON = {  # every shape's config beside its sizes
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def eagle3_head_config(target: ModelConfig, vocab: int, draft_vocab: int) -> dict[str, Any]:
    """A random EAGLE-3 head's config.json for `target` (its width, heads and MLP)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "target_hidden_size": target.hidden_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "max_position_embeddings": 8192,
    }


def random_eagle3_weights(
    config: Eagle3Config, seed: int, device: str | torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The head's weights (no embedding: the target's is read), drawn on `device`; `d2t` maps
    the draft vocabulary to a random sorted subset of the target's."""
    gen = torch.Generator(device).manual_seed(seed)
    h, inter, p = config.hidden_size, config.intermediate_size, HEAD_LAYER
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    draft_vocab = config.draft_vocab_size
    shapes = {
        "fc.weight": (h, config.feature_width),
        p + "self_attn.q_proj.weight": (q, 2 * h),
        p + "self_attn.k_proj.weight": (kv, 2 * h),
        p + "self_attn.v_proj.weight": (kv, 2 * h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        "lm_head.weight": (draft_vocab, h),
    }
    weights = {
        name: 0.02 * torch.randn(shape, generator=gen, device=device, dtype=dtype)
        for name, shape in shapes.items()
    }
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        weights[p + name + ".weight"] = torch.ones(h, device=device, dtype=dtype)
    weights["norm.weight"] = torch.ones(h, device=device, dtype=dtype)
    ids = torch.randperm(config.vocab_size, generator=gen, device=device)[:draft_vocab]
    weights["d2t"] = ids.sort().values - torch.arange(draft_vocab, device=device)
    return weights


def save_eagle3_head(
    out: str, target: LlamaConfig, draft_vocab: int, device: str, dtype: torch.dtype
) -> None:
    """A random EAGLE-3 head for `target` at `out` (config.json + model.safetensors)."""
    raw = eagle3_head_config(ModelConfig.from_hf(target), target.vocab_size, draft_vocab)
    config = Eagle3Config.from_json(raw, target.num_hidden_layers)
    weights = random_eagle3_weights(config, seed=1, device=device, dtype=dtype)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "config.json").write_text(json.dumps(raw, indent=2))
    save_file({k: v.contiguous().cpu() for k, v in weights.items()}, str(Path(out) / HEAD_WEIGHTS))


def mirror(model: LlamaForCausalLM, layers: int, out: str) -> None:
    """Zero `model`'s layers past the first `layers` (attention output and MLP down
    projections: each adds nothing to its input) and save those first layers, with the
    embedding, final norm and LM head, as a draft model at `out` (--mirror-draft)."""
    with torch.no_grad():
        for layer in model.model.layers[layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    config = LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": layers})
    with torch.device(model.device):
        draft = LlamaForCausalLM(config).to(model.dtype)
    kept = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    draft.load_state_dict(kept)
    draft.save_pretrained(out)


def sharpen(model: LlamaForCausalLM, scale: float) -> None:
    """Scale the final norm's weight (the logits) by `scale`, then print the top token's
    probability at temperature 1 over 8 random contexts of 64 tokens (quartiles)."""
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(3, model.config.vocab_size, (8, 64), generator=generator)
        logits = model(ids.to(model.device)).logits.float()  # [8, 64, vocab]
        top = logits.softmax(-1).amax(-1).flatten().cpu()
    quartiles = torch.quantile(top, torch.tensor([0.25, 0.5, 0.75])).tolist()
    print(
        f"logit scale {scale:g}: top token's probability at temperature 1, quartiles "
        + " / ".join(f"{q:.3f}" for q in quartiles)
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--device", default="cpu", help="where the weights are drawn")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--eagle3-head", default=None, help="also write a random EAGLE-3 head here")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="the head's vocabulary")
    parser.add_argument(
        "--mirror-draft",
        default=None,
        help="TIMING ONLY: also write a draft model that predicts it",
    )
    parser.add_argument("--mirror-layers", type=int, default=1, help="the layers that draft keeps")
    parser.add_argument(
        "--logit-scale",
        type=float,
        default=1.0,
        help="TIMING ONLY: the logits this many times sharper (the final norm's weight)",
    )
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    sizes = dict(SHAPES[args.shape])
    sizes["vocab_size"] = min(int(sizes["vocab_size"]), len(tokenizer))
    config = LlamaConfig(**sizes, **COMMON)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    if args.logit_scale != 1.0:
        sharpen(model, args.logit_scale)
    if args.mirror_draft:
        mirror(model, args.mirror_layers, args.mirror_draft)
        tokenizer.save_pretrained(args.mirror_draft)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    if args.eagle3_head:
        draft_vocab = min(args.draft_vocab, config.vocab_size)
        save_eagle3_head(args.eagle3_head, config, draft_vocab, args.device, model.dtype)


if __name__ == "__main__":
    main()
