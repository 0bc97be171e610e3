"""Tiny random-init models of each supported family, for fast exact tests."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

FAMILIES = ("llama", "mistral", "qwen2")

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def tiny_model(family: str = "llama", seed: int = 0, n_layers: int = 4, dtype=torch.float32):
    """A random-init causal LM (GQA 4/2, hidden 64) with a fixed seed; eval mode, fp32 by default."""
    kw = dict(_COMMON, num_hidden_layers=n_layers)
    if family == "llama":
        cfg, cls = LlamaConfig(**kw), LlamaForCausalLM
    elif family == "mistral":
        cfg, cls = MistralConfig(**kw, sliding_window=None), MistralForCausalLM
    elif family == "qwen2":
        cfg, cls = Qwen2Config(**kw, use_sliding_window=False), Qwen2ForCausalLM
    else:
        raise ValueError(f"expected one of {FAMILIES}, got {family!r}")
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return cls(cfg).to(dtype).eval()


def perturbed(model, scale: float = 0.05, seed: int = 1):
    """A copy of ``model`` with every weight nudged by relative Gaussian noise: a tiny 'fine-tune'."""
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale * p.abs().mean())
    return other.eval()
