"""``scd`` (REUSE + PATCH) and ``scd-reuse`` (REUSE only): Semantic Cache Distillation.

REUSE, at every layer not patched: the producer sends the low-rank code ``z = (x_p - mu_p) E``,
the consumer decodes ``x̂_c = mu_c + z D``; either separately for K and V (the paper's form, r_k
and r_v numbers per token instead of 192 each) or one code of the joint [K | V] (r_kv numbers
instead of 384), as the artifacts say. PATCH, at the few transition layers chosen by calibration: the producer
sends a PCA code ``u = (h_p - mu_h) W_H`` of its normalized pre-attention input, the consumer maps
it with its MLP aligner to its own pre-attention space and regenerates K and V with its own
``k_proj``/``v_proj``. Codes travel as int8 with a per-token fp16 scale (or fp16), per the
artifacts. PATCH blocks (when calibration chose one): at a block's entry layer the producer sends its
residual-stream state of the whole prompt (int8 per token), and the consumer runs its own decoder
layers over the block, so the block's K/V are native and drift accumulated before it is reset.
The reference lookup (``_reuse``) and the patch (``_patch``) are separate hooks, so the
projector can be swapped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field, field_validator

from shared.artifacts.meta import ArtifactMeta
from shared.codecs.aligner import Aligner
from shared.codecs.base import SKIP, MethodConfig, TransferMethod, kv_spec, parse_int_list, skip_tensors
from shared.codecs.quant import dequantize_rows, quantize_rows
from shared.codecs.scd_guard import Guards
from shared.codecs.selective_recompute import RecomputesBlocks
from shared.codecs.sparse_block import SparseBlock
from shared.domain import Schema, TensorSpec
from shared.errors import ConfigError, InvalidPayload, InvalidRequest
from shared.model.hf_adapter import from_rows, to_rows


@dataclass
class PairArtifacts:
    """One side's calibration tensors of a pair, loaded from the artifact store."""

    meta: ArtifactMeta
    tensors: dict[str, torch.Tensor]
    side: str
    _spans: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def pin(self) -> str:
        """The artifact set's content hash (``ArtifactMeta.pin``: what it serves, both sides' files included)."""
        return self.meta.pin

    def t(self, name: str, device, dtype=torch.float32) -> torch.Tensor:
        return self.tensors[name].to(device, dtype)

    def span(self, part: str, layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """An orthonormal basis [m, r] of the REUSE encoder's span at ``layer`` (``part``: kv, k or v),
        and the code's mean; computed once per artifacts (methods are made per request, and a QR of
        every block layer's encoder took ~40 ms)."""
        key = (part, layer, str(device))
        if key not in self._spans:
            q, _ = torch.linalg.qr(self.t(f"enc.{part}.{layer}", device, torch.float64))
            self._spans[key] = (q.float(), self.t(f"mu_p.{part}.{layer}", device))
        return self._spans[key]




class SCDSession(SparseBlock):
    method: SCD

    def decode_outside(self, layer, tensors):
        return self.method.decode_tensors(layer, tensors)

    def entry_state(self, tensors, block):
        h = self.method._uncode(tensors, "r", self.model.hidden_size)
        return self.method.map_entry(h, block[0]) if self.method.entry_map else h

    def after_block(self, out, block):
        b = block[1]
        if b in self.method.exit_layers:  # the next layer's native K/V from the block's output state
            k, v = self.model.kv_from_residual(b, out)
            s = self.job.start
            self._block_kv[b] = (k[:, :, s:], v[:, :, s:])

    def decode_layer(self, layer, tensors):
        cfg = self.method
        if cfg.block_tokens >= 1:
            return super().decode_layer(layer, tensors)
        block = cfg.block_at(layer)
        if block is not None:
            return self.sparse_layer(layer, tensors, block)
        if layer in cfg.sparse_exit and self._sparse is not None:
            return self.sparse_exit(layer, tensors)
        return self.decode_outside(layer, tensors)


def code_kind(prefix: str) -> str:
    """The kind of code a tensor prefix belongs to: ``z`` (REUSE: ``zkv``, ``zk``, ``zv``), ``u``, ``r``, ``qkv``."""
    return "z" if prefix.startswith("z") else prefix


def channel_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-channel scale of rows ``x`` [T, width] (fp16 [width]): each channel's RMS after every row
    is normalized to unit RMS, so a few huge rows (an attention sink's state) do not set it."""
    n = x.float() / x.float().pow(2).mean(1, keepdim=True).sqrt().clamp_min(1e-12)
    return n.pow(2).mean(0).sqrt().clamp(1e-3, 6e4).to(torch.float16)


LAST_RECOMPUTED = 16
"""A token-sparse block always recomputes the prompt's last positions (the question, the suffix)."""


class SCD(RecomputesBlocks, Guards, TransferMethod, kind="scd", version=2, compressive=True, cross_model=True,
          requires={"artifacts"}):
    # version 2: a token-sparse block recomputes at least ``block_min_tokens`` positions (version 1:
    # ``block_tokens`` of them alone, fewer than a short prompt's last 16; the streams differ there)
    class Config(MethodConfig):
        kind: Literal["scd"] = "scd"
        patch_layers: Literal["auto", "none"] | list[int] = "auto"
        """``auto``: the layers calibration selected; ``none``: REUSE only; or a subset of the
        calibrated patch layers (``[3, 7]``; ``3,7`` on the command line)."""
        patch_blocks: Literal["auto", "none"] = "auto"
        """``auto``: the PATCH blocks calibration selected (the consumer recomputes them); ``none``:
        REUSE codes on those layers instead."""
        block_tokens: float = Field(1.0, gt=0, le=1)
        """Share of the prompt's positions the consumer recomputes in a PATCH block (CacheBlend-style
        token-sparse recompute; see ``block_select``). The others keep REUSE codes, which then cross
        for the block's layers too. 1 (default): the whole block, nothing but its entry state crosses."""
        block_select: Literal["producer", "attention"] = "producer"
        """With ``block_tokens`` < 1, which positions are recomputed besides the last 16: those the
        prompt's last 32 tokens attend to most, ``producer`` (default) by the producer's own
        attention summed over the block's layers: the producer then sends the entry state of those
        positions only, with their indices (4 bytes each); ``attention``: by the consumer's attention
        at the entry layer, from the entry state of every position (which then crosses whole)."""
        block_fit: Literal["heads", "none"] = "heads"
        """With ``block_tokens`` < 1, ``heads`` (default): before each block layer, the positions
        not recomputed get their REUSE K/V corrected by a ridge map per KV head fitted at run time on
        the recomputed positions (REUSE to native K/V, this prompt only); ``none``: the codes as sent."""
        block_fit_lambda: float = Field(1.0, gt=0)
        """The fit's ridge penalty, relative to the mean variance of the codes' K/V; larger keeps the
        correction nearer the identity."""
        block_fit_span: float = Field(0.25, ge=0)
        """With ``block_fit=heads``, each position not recomputed also takes what the fit still misses
        at the recomputed positions next to it (its residual there, the native K/V minus the fitted),
        weighted by exp(-distance / span) over up to two such positions on each side; 0: the fit only.
        With the defaults a position next to a recomputed one takes all of its residual, two away
        three quarters, three away 6%; chosen on validation (see docs/scd-speed.md, eleventh round)."""
        block_min_tokens: int = Field(128, ge=LAST_RECOMPUTED)
        """With ``block_tokens`` < 1, the fewest positions the block recomputes (a prompt of up to this
        many gets the whole block). On short prompts the share alone left the first positions to the
        codes and was worse than raw (user messages of 20 tokens: KL 0.248 against raw's 0.165 and
        the whole block's 0.031), for no time saved (docs/scd-speed.md, seventeenth round)."""
        block_fit_prior: float = Field(1e-4, gt=0)
        """The weight of "no residual" beside the neighbours' (``block_fit_span``): a position whose nearest
        recomputed ones are more than a few spans away takes almost none of their residual."""
        block_guard: Literal["auto", "none"] = "auto"
        """With ``block_tokens`` < 1 and ``block_select=producer``: ``auto`` serves the whole block to a
        prompt unlike the calibration text, found by the producer after its prefill (its K/V in the
        block's layers further outside what the codes carry than any validation prompt's, by the
        artifacts' ``block_guard``; none if they hold none): in French text the sparse block was
        worse than raw and the whole block far better (docs/scd-speed.md, eighteenth and nineteenth
        rounds). ``none``: the share for every prompt."""
        fallback: Literal["auto", "none"] = "auto"
        """``auto``: on the layers where calibration found the code worse than the producer's own
        K/V, send those (int8 per token); ``none``: the code on every REUSE layer."""
        codes: Literal["auto", "int8"] = "auto"
        """``auto``: the code form calibration chose (levels per kind of code, per-channel scales);
        ``int8``: every code at 256 levels with a per-token scale only (the form before them)."""
        entry_map: Literal["auto", "none"] = "auto"
        """``auto``: where calibration fitted one, the consumer maps a PATCH block's entry state (the
        producer's residual stream) toward its own with a ridge map before running the block;
        ``none``: the producer's state as sent."""
        layer_guard: Literal["auto", "none"] = "none"
        """``auto``: after its prefill the producer checks each layer that would carry a REUSE code:
        where this prompt's K/V lie further outside the code's span than any validation prompt's did
        (the artifacts' ``layer_guard``; none if they hold none), the layer crosses as the producer's
        fp16 K/V instead (``raw_layers``). ``none`` (default for ``scd``): the codes; with the block,
        on 50 held-out prompts of five kinds the guard left KL where it was (0.1454 vs 0.1449) at 2.9x
        the bytes (docs/calibration.md, issue 57). ``scd-reuse`` guards by default."""
        raw_layers: Literal["none"] | list[int] = "none"
        """Layers that cross as the producer's own fp16 K/V (what ``raw`` sends) instead of their REUSE
        code: the layer guard's answer for one prompt (the producer sets it), or given by hand."""

        @field_validator("patch_layers", "raw_layers", mode="before")
        @classmethod
        def _layers(cls, v):
            return parse_int_list(v)

    Session = SCDSession
    cfg: Config

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        art = ctx.artifacts
        if not isinstance(art, PairArtifacts):
            raise ConfigError(f"method {self.kind!r} needs the pair's calibration artifacts; set artifact_store")
        self.art, self.meta = art, art.meta
        self.patch = self._patch_set(getattr(cfg, "patch_layers", "none"))
        use_blocks = getattr(cfg, "patch_blocks", "none") == "auto"
        self.blocks = [(int(a), int(b)) for a, b in self.meta.patch_blocks] if use_blocks else []
        n_layers = ctx.model.n_layers
        self.block_tokens = float(getattr(cfg, "block_tokens", 1.0))
        self.block_min_tokens = int(getattr(cfg, "block_min_tokens", LAST_RECOMPUTED))
        sparse = self.block_tokens < 1  # a sparse block has no full output state: its exit layer carries codes
        if sparse and not self.blocks:  # it would be served as the method without it, and measured as such
            why = ("patch_blocks=none was given" if not use_blocks
                   else f"the {self.meta.pair!r} calibration has no PATCH block")
            raise InvalidRequest(f"block_tokens: {self.block_tokens:g} is the share of a PATCH block's positions "
                                 f"recomputed, and {why}; leave block_tokens out", param="block_tokens")
        self.block_select = getattr(cfg, "block_select", "attention")
        self.sends_positions = sparse and self.block_select == "producer"
        self.block_fit = getattr(cfg, "block_fit", "none")
        self.block_fit_lambda = float(getattr(cfg, "block_fit_lambda", 1.0))
        self.block_fit_span = float(getattr(cfg, "block_fit_span", 0.0))
        self.block_fit_prior = float(getattr(cfg, "block_fit_prior", 1e-4))
        self.guard = float(self.meta.block_guard) if self._guarded(cfg) else 0.0
        """The threshold of ``unlike_calibration`` above which a prompt is served ``guarded_settings`` (0: never)."""
        exits = frozenset(b for _, b in self.blocks if b < n_layers) if self.meta.block_exit_kv else frozenset()
        self.exit_layers = frozenset() if sparse else exits
        self.sparse_exit = exits if sparse else frozenset()
        """After a token-sparse block, the next layer's codes are corrected by the block's fit, and
        the recomputed positions take their native K/V from their block output state."""
        recomputed = {l for a, b in self.blocks for l in range(a, b)} | self.exit_layers
        self.patch -= recomputed
        self.raw_kv = getattr(cfg, "fallback", "auto") == "raw"
        """Every layer the code would carry crosses as the producer's own K/V in fp16, as ``raw`` sends
        them (what ``scd-reuse`` serves a prompt its guard finds unlike the calibration text)."""
        use_fallback = getattr(cfg, "fallback", "auto") == "auto"
        self.fallback = (frozenset(self._fallback_layers()) - self.patch - recomputed
                         if use_fallback else frozenset())
        self.code_layers = frozenset(range(n_layers)) - self.patch - recomputed - self.fallback - self.sparse_exit
        """Layers that carry a REUSE code (outside a whole block; a token-sparse block's codes are
        corrected by its own fit): where the layer guard looks."""
        raw = getattr(cfg, "raw_layers", "none")
        self.raw_layers: frozenset[int] = frozenset() if raw == "none" else frozenset(int(x) for x in raw)
        reuse = self.code_layers | self.fallback
        if not self.raw_layers <= reuse:
            raise InvalidRequest(f"raw_layers: layers {sorted(self.raw_layers - reuse)} carry no REUSE code here "
                                 f"(those that do: {sorted(reuse) or 'none'})", param="raw_layers")
        self.layer_guard = ({l: t for l, t in self.meta.layer_guard.items() if l in self.code_layers - self.raw_layers}
                            if getattr(cfg, "layer_guard", "none") == "auto" and not self.raw_kv else {})
        """Per code layer, the out-of-span share above which this prompt's layer crosses raw (empty: no check)."""
        self._aligners: dict[int, Aligner] = {}
        calibrated = getattr(cfg, "codes", "int8") == "auto" and self.meta.code_bits == 8
        self.levels = dict(self.meta.code_levels) if calibrated and self.uses_levels else {}
        self.channel = frozenset(self.meta.code_channel) if calibrated else frozenset()
        self.entry_map = getattr(cfg, "entry_map", "none") == "auto" and self.meta.block_entry_map
        held = art.tensors if self.entry_map and art.side == "consumer" else None  # only the consumer applies it
        missing = [] if held is None else [f"entry.{x}.{a}" for a, _ in self.blocks for x in ("w", "mu_p", "mu_c")
                                           if f"entry.{x}.{a}" not in held]
        if missing:
            raise ConfigError(f"the {self.meta.pair!r} artifacts declare a block entry map but lack {missing}: "
                              f"recalibrate (scd calibrate --pair {self.meta.pair} --method refine)")

    uses_levels = True
    """Whether the artifacts' code levels apply (calibration chose them for ``scd``)."""

    def _patch_set(self, spec: str | list[int]) -> frozenset[int]:
        have = frozenset(self.meta.patch_layers)
        if spec == "auto":
            return have
        if isinstance(spec, str):  # "none"
            return frozenset()
        want = frozenset(spec)
        if not want <= have:
            raise InvalidRequest(f"patch_layers: layers {sorted(want - have)} were not calibrated for pair "
                                 f"{self.meta.pair!r}; it has {sorted(have) or 'none'} (or give auto, none)",
                                 param="patch_layers")
        return want

    def _fallback_layers(self) -> list[int]:
        return self.meta.fallback_layers

    def hidden_layers(self) -> tuple[int, ...]:
        scored = {l for a, b in self.blocks for l in range(a, b)} if self.sends_positions else set()
        return tuple(sorted(self.patch | scored))

    def rank(self, layer: int) -> int:
        """The joint code's rank at ``layer``."""
        return self.meta.layer_ranks.get(layer, self.meta.r_kv)

    def pin(self) -> str:
        return self.art.pin

    # ------------------------------------------------------------------ producer
    def _code(self, x: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
        if self.meta.code_bits == 16:
            return {prefix: x.to(torch.float16)}
        kind, out = code_kind(prefix), {}
        if kind in self.channel:
            c = channel_scale(x)
            x, out[f"{prefix}_channel"] = x / c.float(), c
        q, s = quantize_rows(x, self.levels.get(kind, 8))
        return {prefix: q, f"{prefix}_scale": s, **out}

    def encode_layer(self, state, layer, start):
        dev = state.keys[layer].device
        a = self.art
        block = self.block_at(layer)
        if block is not None:  # the whole prompt's state at the entry: the recompute attends to every position
            entry = self._entry_tensors(state, block, start) if layer == block[0] else {}
            if self.block_tokens < 1:  # a sparse block: the positions not recomputed need their codes
                return {**entry, **self._encode_reuse(state, layer, start)}
            return entry or skip_tensors()
        if layer in self.exit_layers:
            return skip_tensors()
        if layer in self.patch:
            h = state.hidden[layer][0, start:].float()
            u = (h - a.t(f"mu_h.{layer}", dev)) @ a.t(f"wh.{layer}", dev)
            return self._code(u, "u")
        return self._encode_reuse(state, layer, start)

    def n_keep(self, n_tokens: int, start: int) -> int:
        """How many positions a token-sparse block recomputes: ``block_tokens`` of those after the
        native prefix, at least ``block_min_tokens`` of them (and so at least the last 16). A short
        prompt's budget was its share only (4 of a 12-token prompt), below the last 16 the rule
        promises: "The capital of France is Paris. The capital of Germany is" was answered "Paris"
        at 0.35, "Berlin" by the whole block."""
        n = n_tokens - start
        return min(n, max(self.block_min_tokens, round(self.block_tokens * n)))

    def _entry_tensors(self, state, block, start) -> dict[str, torch.Tensor]:
        """A block entry's tensors: the residual-stream state of every position, or for a token-sparse
        block whose positions the producer chooses, of those positions only, with the positions."""
        h = state.residual[block[0]][0].float()
        if not self.sends_positions:
            return self._code(h, "r")
        idx = self.top_positions(self._scores(state, block), start)
        return {**self._code(h[idx], "r"), "pos": idx.to(torch.int32)}

    def top_positions(self, score: torch.Tensor, start: int) -> torch.Tensor:
        """The positions a token-sparse block recomputes, sorted: the prompt's last 16, then the
        highest ``score`` [n_tokens], never the native prefix [0, start) (its K/V are the consumer's
        own already); ``n_keep`` of them."""
        n = score.shape[0]
        score = score.float().clone()
        score[n - min(LAST_RECOMPUTED, n):] = float("inf")
        score[:start] = float("-inf")
        return torch.topk(score, self.n_keep(n, start)).indices.sort().values

    def _scores(self, state, block) -> torch.Tensor:
        """How much the prompt's last 32 tokens attend to each position [n_tokens], in the
        producer's own attention summed over the block's layers (which positions a token-sparse
        block recomputes)."""
        m = self.ctx.model
        a, b = block
        score = m.attention_mass_of(a, state.hidden[a], state.keys[a], 32)
        for layer in range(a + 1, b):
            score = score + m.attention_mass_of(layer, state.hidden[layer], state.keys[layer], 32)
        return score

    def _encode_reuse(self, state, layer, start):
        dev, a = state.keys[layer].device, self.art
        if self.raw_kv or layer in self.raw_layers:
            return {x: y[layer][:, :, start:].to(torch.float16) for x, y in (("k", state.keys), ("v", state.values))}
        k, v = (to_rows(x[:, :, start:]).float() for x in (state.keys[layer], state.values[layer]))
        if layer in self.fallback:
            return self._code(torch.cat([k, v], 1), "qkv")
        parts = (("kv", torch.cat([k, v], 1)),) if self.meta.reuse_code == "joint" else (("k", k), ("v", v))
        out = {}
        for kv, x in parts:
            z = (x - a.t(f"mu_p.{kv}.{layer}", dev)) @ a.t(f"enc.{kv}.{layer}", dev)
            out.update(self._code(z, f"z{kv}"))
        return out

    def _code_schema(self, prefix: str, rows: int, width: int) -> Schema:
        if self.meta.code_bits == 16:
            return {prefix: TensorSpec(torch.float16, (rows, width))}
        out = {prefix: TensorSpec(torch.int8, (rows, width)), f"{prefix}_scale": TensorSpec(torch.float16, (rows, 1))}
        if code_kind(prefix) in self.channel:
            out[f"{prefix}_channel"] = TensorSpec(torch.float16, (width,))
        return out

    def schema(self, layer, job):
        block, meta = self.block_at(layer), self.meta
        if block is not None:
            rows = self.n_keep(job.n_tokens, job.start) if self.sends_positions else job.n_tokens
            entry = self._code_schema("r", rows, self.ctx.model.hidden_size) if layer == block[0] else {}
            if entry and self.sends_positions:
                entry["pos"] = TensorSpec(torch.int32, (rows,))
            if self.block_tokens < 1:
                return {**entry, **self._reuse_schema(layer, job)}
            return entry or SKIP
        if layer in self.exit_layers:
            return SKIP
        if layer in self.patch:
            return self._code_schema("u", job.n_transfer, meta.r_h)
        return self._reuse_schema(layer, job)

    def _reuse_schema(self, layer, job):
        meta, n = self.meta, job.n_transfer
        if self.raw_kv or layer in self.raw_layers:
            spec = kv_spec(self.ctx.model, n, torch.float16)
            return {"k": spec, "v": spec}
        if layer in self.fallback:
            return self._code_schema("qkv", n, 2 * self.ctx.model.kv_dim)
        if meta.reuse_code == "joint":
            return self._code_schema("zkv", n, self.rank(layer))
        return {**self._code_schema("zk", n, meta.r_k), **self._code_schema("zv", n, meta.r_v)}

    # ------------------------------------------------------------------ consumer
    def _uncode(self, tensors, prefix: str, width: int) -> torch.Tensor:
        try:
            x = tensors[prefix]
            x = x.float() if self.meta.code_bits == 16 else dequantize_rows(x, tensors[f"{prefix}_scale"])
            c = tensors[f"{prefix}_channel"].float() if code_kind(prefix) in self.channel else None
        except KeyError as e:
            raise InvalidPayload(f"{self.kind} payload lacks tensor {e.args[0]!r}") from None
        if x.dim() != 2 or x.shape[1] != width:
            raise InvalidPayload(f"{self.kind} code {prefix!r} has shape {tuple(x.shape)}; expected [T, {width}]")
        if c is not None:
            if c.shape != (width,) or not (torch.isfinite(c).all() and (c > 0).all()):
                raise InvalidPayload(f"{self.kind} code {prefix!r}: its per-channel scales must be {width} finite "
                                     "positive numbers")
            x = x * c
        return x

    def _reuse(self, layer, tensors):
        m = self.ctx.model
        dev, a = m.device, self.art
        if self.raw_kv or layer in self.raw_layers:  # names, dtypes and shapes checked against the schema
            return tensors["k"], tensors["v"]
        if layer in self.fallback:  # the producer's own K/V, int8 per token
            x = self._uncode(tensors, "qkv", 2 * m.kv_dim).to(dev)
            return tuple(from_rows(y, m.n_kv_heads, m.head_dim) for y in (x[:, : m.kv_dim], x[:, m.kv_dim:]))
        joint = self.meta.reuse_code == "joint"
        parts = (("kv", self.rank(layer)),) if joint else (("k", self.meta.r_k), ("v", self.meta.r_v))
        xs = []
        for kv, r in parts:
            z = self._uncode(tensors, f"z{kv}", r).to(dev)
            xs.append(a.t(f"mu_c.{kv}.{layer}", dev) + z @ a.t(f"dec.{kv}.{layer}", dev))
        if joint:
            xs = [xs[0][:, : m.kv_dim], xs[0][:, m.kv_dim:]]
        return tuple(from_rows(x, m.n_kv_heads, m.head_dim) for x in xs)

    def _aligner(self, layer) -> Aligner:
        if layer not in self._aligners:
            pre = f"align.{layer}."
            state = {k[len(pre):]: v.float() for k, v in self.art.tensors.items() if k.startswith(pre)}
            self._aligners[layer] = Aligner.from_state(state).to(self.ctx.model.device)
        return self._aligners[layer]

    def _patch(self, layer, tensors):
        u = self._uncode(tensors, "u", self.meta.r_h).to(self.ctx.model.device)
        with torch.inference_mode():
            h = self._aligner(layer)(u).unsqueeze(0)
        return self.ctx.model.regenerate_kv(layer, h)

    def map_entry(self, h: torch.Tensor, layer: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Entry states [rows, d] (of every position, or of ``positions``) mapped toward the consumer's
        own residual stream at block entry ``layer`` (``x + (x - mu_p) W + mu_c - mu_p``); position 0,
        the attention sink, keeps the producer's state (the map is not fitted on it)."""
        dev = h.device
        w, mp, mc = (self.art.t(f"entry.{x}.{layer}", dev) for x in ("w", "mu_p", "mu_c"))
        x = h.float()
        out = (x + (x - mp) @ w + (mc - mp)).to(h.dtype)
        sink = (positions == 0) if positions is not None else torch.arange(h.shape[0], device=dev) == 0
        out[sink] = h[sink]
        return out

    def decode_tensors(self, layer, tensors):
        return self._patch(layer, tensors) if layer in self.patch else self._reuse(layer, tensors)
