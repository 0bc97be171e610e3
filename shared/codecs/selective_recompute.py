"""``droidspeak``: DroidSpeak-style selective recompute. The producer's raw K/V (fp16) cross for
most layers; for each contiguous recompute block [a, b) the producer sends its residual-stream
state at the block entry instead, and the consumer runs its *own* layers a..b-1 over it to get
native K/V there. Blocks come from offline profiling on the validation split (an artifact of the
pair) or from the ``blocks`` setting."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Literal

import torch
from pydantic import field_validator

from shared.codecs.base import SKIP, DecodeSession, MethodConfig, TransferMethod, kv_spec, parse_blocks, skip_tensors
from shared.domain import TensorSpec
from shared.errors import ConfigError, InvalidPayload, InvalidRequest, clip


def check_blocks(blocks: list, n_layers: int) -> list[tuple[int, int]]:
    """Blocks [(a, b), ...] (end exclusive), validated against the depth and non-overlapping."""
    out = []
    for blk in blocks:
        if not isinstance(blk, (list, tuple)) or len(blk) != 2 or not all(isinstance(x, int) for x in blk):
            raise InvalidRequest(f"blocks: a block is two layer numbers [FIRST, END], END exclusive (e.g. [3, 6] or "
                                 f"3-6); got {clip(repr(blk))}", param="blocks")
        a, b = blk
        if a >= b:
            raise InvalidRequest(f"blocks: block {a}-{b} holds no layer: END is exclusive and must be above FIRST "
                                 f"(e.g. {a}-{a + 1} is layer {a} alone)", param="blocks")
        if a < 0 or b > n_layers:
            raise InvalidRequest(f"blocks: block {a}-{b} is outside the model's {n_layers} layers (FIRST from 0, END "
                                 f"at most {n_layers})", param="blocks")
        out.append((a, b))
    out.sort()
    if any(b1 > a2 for (_, b1), (a2, _) in zip(out, out[1:])):
        raise InvalidRequest(f"blocks: {', '.join(f'{a}-{b}' for a, b in out)} overlap; give each layer to one block",
                             param="blocks")
    return out


class RecomputesBlocks:
    """A method with contiguous recompute blocks ``self.blocks`` [(a, b), ...] (end exclusive):
    which block a layer is in, and the entry layers whose residual state the producer must keep."""

    blocks: list[tuple[int, int]]

    def block_at(self, layer: int) -> tuple[int, int] | None:
        return next(((a, b) for a, b in self.blocks if a <= layer < b), None)

    def residual_layers(self) -> tuple[int, ...]:
        return tuple(a for a, _ in self.blocks)


class BlockSession(DecodeSession):
    """A session whose method recomputes contiguous blocks of layers: at a block's entry the
    consumer runs its own decoder layers over the producer's residual-stream state and keeps their
    K/V, which the following layers of the block then return. DroidSpeak and SCD's PATCH blocks."""

    method: Any  # a TransferMethod that is also RecomputesBlocks (SCD, DroidSpeak)

    def __init__(self, method, job):
        super().__init__(method, job)
        self._block_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def decode_layer(self, layer, tensors):
        if layer in self._block_kv:  # inside a block: recomputed at its entry
            return self._block_kv.pop(layer)
        block = self.method.block_at(layer)
        if block is None:
            return self.decode_outside(layer, tensors)
        return self.run_block(self.entry_state(tensors, block), block)

    @abstractmethod
    def decode_outside(self, layer: int, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of a layer outside every block, from its tensors."""

    @abstractmethod
    def entry_state(self, tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> torch.Tensor:
        """The residual-stream state [n_tokens, d] a block's entry layer carries."""

    def run_block(self, h: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Recompute ``block`` [a, b) from the entry state ``h`` [n_tokens, d]; the K/V of layer a."""
        a, b = block
        self.check_entry(h, block)
        out, ks, vs = self.model.run_layers(h.unsqueeze(0), a, b)
        s = self.job.start
        for i, layer_i in enumerate(range(a, b)):
            self._block_kv[layer_i] = (ks[i][:, :, s:], vs[i][:, :, s:])
        self.after_block(out, block)
        return self._block_kv.pop(a)

    def check_entry(self, h: torch.Tensor, block: tuple[int, int]) -> None:
        """The entry state must be [n_tokens, d] (``InvalidPayload`` otherwise)."""
        want = (self.job.n_tokens, self.model.hidden_size)
        if h.dim() != 2 or tuple(h.shape) != want:
            raise InvalidPayload(f"{self.method.kind} block {block[0]}-{block[1]} entry state has shape "
                                 f"{tuple(h.shape)}; expected {want}")

    def after_block(self, out: torch.Tensor, block: tuple[int, int]) -> None:
        """A hook with the block's output residual state [1, n_tokens, d]; nothing by default."""


class DroidSpeakSession(BlockSession):
    method: DroidSpeak

    def decode_outside(self, layer, tensors):
        return tensors["k"], tensors["v"]  # names, dtypes and shapes checked against the schema

    def entry_state(self, tensors, block):
        return tensors["h"]


class DroidSpeak(RecomputesBlocks, TransferMethod, kind="droidspeak", cross_model=True, requires={"profile"}):
    class Config(MethodConfig):
        kind: Literal["droidspeak"] = "droidspeak"
        blocks: Literal["auto"] | list[list[int]] = "auto"
        """``auto``: the blocks profiled for the pair; or explicit blocks ``[[a, b], ...]`` (end
        exclusive; ``a-b,c-d`` on the command line)."""

        @field_validator("blocks", mode="before")
        @classmethod
        def _blocks(cls, v):
            return parse_blocks(v)

    Session = DroidSpeakSession

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        n = ctx.model.n_layers
        if cfg.blocks == "auto":
            prof = ctx.profiles.get("droidspeak")
            if prof is None:
                raise ConfigError("droidspeak needs the pair's profiled blocks (scd calibrate --method droidspeak) "
                                  "or an explicit blocks setting")
            self.blocks = [(int(a), int(b)) for a, b in prof["blocks"]]
            self._pin = str(prof.get("pin", ""))
        else:
            self.blocks = check_blocks(cfg.blocks, n)
            self._pin = ""

    def pin(self) -> str:
        return self._pin

    def encode_layer(self, state, layer, start):
        block = self.block_at(layer)
        if block is None:
            return {"k": state.keys[layer][:, :, start:].half(), "v": state.values[layer][:, :, start:].half()}
        if layer == block[0]:  # the whole prompt: the consumer's recompute attends to every position
            return {"h": state.residual[layer][0].half()}
        return skip_tensors()

    def schema(self, layer, job):
        m = self.ctx.model
        block = self.block_at(layer)
        if block is None:
            spec = kv_spec(m, job.n_transfer)
            return {"k": spec, "v": spec}
        return {"h": TensorSpec(torch.float16, (job.n_tokens, m.hidden_size))} if layer == block[0] else SKIP
