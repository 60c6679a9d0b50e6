"""An EAGLE-3 head that trains: the math of drafter/eagle.py as an nn.Module over dense batches,
unrolled over draft steps (EAGLE-3's training-time test, TTT).

Alignment (as in drafter/eagle_proposer.py): tokens x_0..x_{T-1}, target features h_j (the aux
layers' outputs at position j). Entry i (i = 0..T-2, RoPE position i) reads embed(x_{i+1}) and
predicts x_{i+2}: the target's distribution at position i + 1.

Step 0: entry i's feature is fc(h_i); it attends to the step-0 entries 0..i.
Step k >= 1 is the k-th draft node after the root r = i - k: entry i's feature is the head's
step k-1 output at entry i - 1 (its parent), and it attends to the step-0 entries 0..r plus, for
s = 1..k, the step-s key at entry r + s (the nodes above it and itself). With the true tokens as
inputs this is the chain a greedy drafter proposes as long as every earlier draft was right,
which is the case acceptance depends on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from drafter.eagle import Eagle3Head
from drafter.eagle_checkpoint import HEAD_WEIGHTS, Eagle3Config
from specsplit.model.llama import RMSNorm
from specsplit.model.rope import apply_rotary, rope_cos_sin, rope_inv_freq


def _norm(dim: int, eps: float) -> RMSNorm:
    """The model's RMSNorm, materialized (weight 1) so that it trains."""
    norm = RMSNorm(dim, eps, device="cpu")
    nn.init.ones_(norm.weight)
    return norm


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        h = c.hidden_size
        self.q_proj = nn.Linear(2 * h, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = _norm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _norm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _norm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


class Eagle3Trainable(nn.Module):
    """Parameters named as the published checkpoint's keys (state_dict() is the layout)."""

    def __init__(
        self, config: Eagle3Config, embed: torch.Tensor, draft_ids: torch.Tensor | None
    ) -> None:
        """embed: the target's token embedding [V, H] (frozen). draft_ids: the target ids of
        the draft vocabulary [Vd], sorted (None: Vd = V)."""
        super().__init__()
        c = config
        self.config = c
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = _norm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.embed: torch.Tensor
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        if draft_ids is None:
            draft_ids = torch.arange(c.vocab_size)
        assert draft_ids.shape == (c.draft_vocab_size,), draft_ids.shape
        self.draft_ids: torch.Tensor
        self.register_buffer("draft_ids", draft_ids.long(), persistent=False)
        self.inv_freq: torch.Tensor
        self.register_buffer(
            "inv_freq", rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling), persistent=False
        )

    @classmethod
    def from_head(cls, head: Eagle3Head) -> Eagle3Trainable:
        """A trainable copy of an inference head (fine-tuning a published head, tests)."""
        c = head.config
        draft_ids = (
            None if head.d2t is None else head.to_target_ids(torch.arange(c.draft_vocab_size))
        )
        model = cls(c, head.embed, draft_ids).to(device=head.device, dtype=head.dtype)
        weights = {k: v for k, v in head.w.items() if k not in ("d2t", "t2d")}
        model.load_state_dict(weights, strict=True)
        return model

    def init_from_target(
        self, target_norm: torch.Tensor, target_lm_head: torch.Tensor, seed: int
    ) -> None:
        """Small random layer weights; the LM head starts as the target's (rows of the draft
        vocabulary), so the head's output lives in the target's last hidden space."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[1])))
            self.midlayer.self_attn.o_proj.weight.mul_(0.1)
            self.midlayer.mlp.down_proj.weight.mul_(0.1)
            # a tenth of the target's final norm: soft initial logits (a random feature
            # through the target's own head would be confidently wrong)
            self.norm.weight.copy_(0.1 * target_norm)
            self.lm_head.weight.copy_(target_lm_head[self.draft_ids.to(target_lm_head.device)])

    def forward(
        self, input_ids: torch.Tensor, features: torch.Tensor, num_steps: int
    ) -> list[torch.Tensor]:
        """input_ids [B, T], features [B, T, 3 * Ht] -> per step, pre-norm outputs [B, T-1, H]
        (entry i of step k predicts x_{i+2}; rows i < k have no root and are garbage)."""
        c, layer = self.config, self.midlayer
        n = input_ids.shape[1] - 1
        emb = layer.input_layernorm(self.embed[input_ids[:, 1:]])  # [B, n, H]
        positions = torch.arange(n, device=input_ids.device)
        cos, sin = rope_cos_sin(positions, self.inv_freq, emb.dtype)  # [n, D]
        feature = self.fc(features[:, :n].to(emb.dtype))  # [B, n, H]
        keys: list[torch.Tensor] = []  # per step [B, kv_heads, n, D], RoPE applied
        values: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        for _ in range(num_steps):
            x = torch.cat([emb, layer.hidden_norm(feature)], dim=-1)  # [B, n, 2H]
            attn = layer.self_attn
            b = x.shape[0]
            q = attn.q_proj(x).view(b, n, c.num_heads, c.head_dim)
            k = attn.k_proj(x).view(b, n, c.num_kv_heads, c.head_dim)
            v = attn.v_proj(x).view(b, n, c.num_kv_heads, c.head_dim)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            keys.append(k.transpose(1, 2))
            values.append(v.transpose(1, 2))
            o = _ttt_attention(q.transpose(1, 2), keys, values)  # [B, heads, n, D]
            h = feature + attn.o_proj(o.transpose(1, 2).reshape(b, n, -1))
            out = h + layer.mlp(layer.post_attention_layernorm(h))  # [B, n, H]
            outputs.append(out)
            # step k+1's entry i reads its parent: step k's output at entry i - 1
            feature = F.pad(out[:, :-1], (0, 0, 1, 0))
        return outputs

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs [..., H] -> draft-vocabulary logits [..., Vd]."""
        return self.lm_head(self.norm(outputs))

    def save(self, directory: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        """Write the head in the published layout (config.json + model.safetensors)."""
        from safetensors.torch import save_file

        c = self.config
        tensors = {
            k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()
        }
        if c.draft_vocab_size != c.vocab_size:
            ids = self.draft_ids.cpu()
            tensors["d2t"] = ids - torch.arange(c.draft_vocab_size)
            t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            tensors["t2d"] = t2d
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(directory / HEAD_WEIGHTS))
        (directory / "config.json").write_text(json.dumps(head_config_json(c), indent=2))
        return directory


def _ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> torch.Tensor:
    """Step k = len(keys) - 1: q [B, heads, n, D]; keys/values per step [B, kv_heads, n, D].
    Query i sees step-0 keys 0..i-k and the step-s key at i - (k - s) for s = 1..k."""
    k_steps = len(keys) - 1
    groups = q.shape[1] // keys[0].shape[1]
    n = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])

    def expand(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(groups, dim=1)

    scores0 = (q @ expand(keys[0]).transpose(-1, -2)) * scale  # [B, heads, n, n]
    i = torch.arange(n, device=q.device)
    visible = i[None, :] <= (i[:, None] - k_steps)  # [n, n]
    scores0 = scores0.masked_fill(~visible, float("-inf"))
    diag_scores, diag_values = [], []
    for s in range(1, k_steps + 1):
        shift = k_steps - s  # the step-s key of query i sits at entry i - shift
        k_s = F.pad(expand(keys[s]), (0, 0, shift, 0))[:, :, :n]
        v_s = F.pad(expand(values[s]), (0, 0, shift, 0))[:, :, :n]
        diag_scores.append((q * k_s).sum(-1, keepdim=True) * scale)  # [B, heads, n, 1]
        diag_values.append(v_s)
    probs = torch.softmax(torch.cat([scores0, *diag_scores], dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :n] @ expand(values[0])
    for s, v_s in enumerate(diag_values):
        out = out + probs[..., n + s : n + s + 1] * v_s
    return out


def head_config_json(c: Eagle3Config) -> dict:  # type: ignore[type-arg]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "target_hidden_size": c.target_hidden_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layers)},
        **({"rope_scaling": c.rope_scaling} if c.rope_scaling else {}),
    }
