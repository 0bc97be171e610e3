"""Tiny random-init models of each supported family, for fast exact tests."""

from __future__ import annotations

from typing import Any

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=8192,  # RoPE: no weight depends on it; long enough for the decode tests
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def tiny_config(family: str = "llama", n_layers: int = 4, vocab_size: int = 256, sliding_window: int | None = None):
    """The config of a tiny model (GQA 4/2, hidden 64, head_dim 16). ``sliding_window`` gives Mistral
    a window on every layer, Gemma 2 a window on its alternate (sliding) layers, and Qwen2/3 windows on
    their sliding layers; None keeps every layer full attention (Gemma 2 then gets a window longer than
    any test prompt)."""
    import transformers as tf

    kw = dict(_COMMON, num_hidden_layers=n_layers, vocab_size=vocab_size)
    cfg: Any
    if family == "llama":
        cfg = tf.LlamaConfig(**kw)
    elif family == "mistral":
        cfg = tf.MistralConfig(**kw, sliding_window=sliding_window)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**kw, use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
                             max_window_layers=n_layers // 2)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**kw, use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
                             max_window_layers=n_layers // 2)
    elif family == "gemma":
        cfg = tf.GemmaConfig(**kw)
    elif family == "gemma2":
        cfg = tf.Gemma2Config(**kw, sliding_window=sliding_window or 4096, query_pre_attn_scalar=16,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    else:
        raise ValueError(f"expected one of {FAMILIES}, got {family!r}")
    return cfg


def tiny_model(family: str = "llama", seed: int = 0, n_layers: int = 4, dtype=torch.float32,
               sliding_window: int | None = None, vocab_size: int = 256):
    """A random-init causal LM (GQA 4/2, hidden 64) with a fixed seed; eval mode, fp32 by default."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, n_layers, vocab_size, sliding_window)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def perturbed(model, scale: float = 0.05, seed: int = 1):
    """A copy of ``model`` with every weight nudged by relative Gaussian noise: a tiny 'fine-tune'."""
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * scale * p.abs().mean())
    return other.eval()



CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(seed: int = 0):
    """256 ids, like the tiny models: 3 special tokens, printable ASCII and newline, then filler
    characters, so that every id the model can emit decodes to one character; a chat template.
    ``seed`` > 0 shuffles the characters' ids (another vocabulary of the same size)."""
    import random

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    chars += [chr(0x100 + i) for i in range(256 - len(specials) - len(chars))]
    if seed:
        random.Random(seed).shuffle(chars)
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=specials[1:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_pretrained(model, folder, tokenizer=None) -> str:
    """Save a model (safetensors) and optionally a tokenizer: an operator's Hugging Face folder."""
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return str(folder)


def shaped_model(n_layers: int, hidden_size: int, n_kv_heads: int, head_dim: int, n_heads: int | None = None):
    """A random-init Llama with a pair's attention shapes (layers, hidden size, KV heads, head width)
    and a token-sized FFN and vocabulary: what a codec needs to be made against a pair's artifacts
    (their shapes are checked) without its weights, e.g. to check committed tables in a test."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=16, hidden_size=hidden_size, intermediate_size=8, num_hidden_layers=n_layers,
                         num_attention_heads=n_heads or hidden_size // head_dim, num_key_value_heads=n_kv_heads,
                         head_dim=head_dim, max_position_embeddings=8192, tie_word_embeddings=True)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()
