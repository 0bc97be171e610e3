"""What the project's transfer methods need of a model, for an engine that owns the weights.

The codecs read a model's geometry (layers, KV heads, head size), its device and dtype, and its RoPE
(keys cross the wire pre-RoPE; the consumer rotates them to its positions). Inside vLLM the weights
belong to the engine, so ``EngineModel`` holds none: the geometry comes from the HF config, the
rotary embedding from the family's own HF module built from that config (a few KB of frequencies).
"""

from __future__ import annotations

import importlib

import torch

from shared.errors import ConfigError
from shared.model.hf_adapter import check_supported, kv_geometry, rotate_half


def _rotary(config) -> torch.nn.Module:
    """The family's HF rotary embedding (``LlamaRotaryEmbedding(config)``, ...), no weights."""
    mt = config.model_type
    module = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    arch = (getattr(config, "architectures", None) or [""])[0].replace("ForCausalLM", "")
    names = [f"{arch}RotaryEmbedding"] + sorted(n for n in dir(module) if n.endswith("RotaryEmbedding"))
    for name in names:
        cls = getattr(module, name, None)
        if cls is not None:
            return cls(config=config)
    raise ConfigError(f"no rotary embedding found for model type {mt!r} in {module.__name__}")


class EngineModel:
    """Geometry, device, dtype and RoPE of the engine's model: a stand-in for ``ModelAdapter``
    where the codecs only need those (raw, quant, scd-reuse)."""

    def __init__(self, config, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        check_supported(config.model_type)
        self.config = config
        self.n_layers, self.n_kv_heads, self.head_dim, self.hidden_size, self.kv_dim = kv_geometry(config)
        self.device, self.dtype = torch.device(device), dtype
        self._rotary = _rotary(config).to(self.device)

    def _cos_sin(self, like: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + like.shape[2], device=like.device).unsqueeze(0)
        cos, sin = self._rotary(like, position_ids=pos)  # each [1, T, D]
        return cos.unsqueeze(1), sin.unsqueeze(1)

    @torch.no_grad()
    def apply_rope(self, keys: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Pre-RoPE keys [B, H, T, D] rotated to positions start.. (the consumer's cache entries)."""
        cos, sin = self._cos_sin(keys, start)
        return keys * cos + rotate_half(keys) * sin

    @torch.no_grad()
    def remove_rope(self, keys: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The inverse rotation: keys [B, H, T, D] as a paged cache holds them, back to pre-RoPE."""
        cos, sin = self._cos_sin(keys, start)
        return keys * cos - rotate_half(keys) * sin

    @torch.no_grad()
    def rope_tables(self, length: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [1, 1, length, D] of positions start..start+length-1, for ``rotate``."""
        return self._cos_sin(torch.empty(1, 1, length, 1, dtype=self.dtype, device=self.device), start)

    def rotate(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys [B, H, T, D] rotated by tables from ``rope_tables`` (the consumer's cache entries)."""
        keys = keys.to(self.device, self.dtype)
        return keys * cos + rotate_half(keys) * sin
