"""What the producer's and the consumer's engines share: the model and its adapter, the weights
fingerprint, the prompt format, one torch worker thread (torch work off the event loop, device use
serial), and loading a pair's calibration artifacts and profiles into a codec context."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shared.codecs import CODECS, CodecContext, check_enabled
from shared.errors import ConfigError
from shared.model.fingerprint import weights_fingerprint
from shared.model.hf_adapter import ModelAdapter
from shared.model.prompt import PromptFormat
from shared.paths import profile_path


class TorchWorker:
    """One worker thread for torch work: ``await run(fn, *args)``."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Engine(TorchWorker):
    """Base of ``ProducerEngine`` and ``ConsumerEngine``. ``settings.methods`` must all be registered."""

    def __init__(self, settings, model, tokenizer, name: str):
        check_enabled(settings.methods, allow=("auto",) if name == "producer" else ())
        self.settings = settings
        self.adapter = ModelAdapter(model)
        self.tokenizer = tokenizer
        self.format = PromptFormat(tokenizer) if tokenizer is not None else None
        self.fingerprint = weights_fingerprint(model)
        m = getattr(settings, "model", None)
        if m is not None and m.fingerprint and m.fingerprint != self.fingerprint:
            raise ConfigError(f"the weights in {m.path} changed since the pair was registered (fingerprint "
                              f"{self.fingerprint}, registered {m.fingerprint}): run `scd pair add NAME ... --replace` "
                              "and recalibrate (for a built-in pair, `scd assets`), or serve the registered weights")
        ctx = getattr(self.adapter.config, "max_position_embeddings", None)
        self.context: int | None = int(ctx) if isinstance(ctx, int) and ctx > 0 else None
        """Positions the model was trained for (its config's max_position_embeddings), if it says."""
        TorchWorker.__init__(self, name)

    def prompt_limit(self) -> tuple[int, str]:
        """The most prompt tokens a request may have, and what sets it: the setting, never past the
        model's context."""
        setting = self.settings.max_prompt_tokens
        if setting is None:
            return (self.context, "the model's context") if self.context else (UNKNOWN_CONTEXT_TOKENS,
                                                                               "max_prompt_tokens' default")
        if self.context and self.context < setting:
            return self.context, "the model's context"
        return setting, "max_prompt_tokens"

    def load_context(self, folder: str | Path | None, side: str, producer_fp: str | None = None,
                     consumer_fp: str | None = None, require: tuple[str, ...] = ()) -> CodecContext:
        return load_context(self.adapter, folder, side, producer_fp, consumer_fp, require)


UNKNOWN_CONTEXT_TOKENS = 4096
"""The prompt limit where ``max_prompt_tokens`` is unset and the model's config gives no context window."""

PROFILE_KINDS = (*(k for k, cls in CODECS.items() if "profile" in cls.requires), "auto")
"""Profiles a pair may have beside its SCD artifacts: the baselines' and ``auto``'s operating table."""


def load_context(adapter: ModelAdapter, folder: str | Path | None, side: str, producer_fp: str | None = None,
                 consumer_fp: str | None = None, require: tuple[str, ...] = (),
                 profiles: tuple[str, ...] = PROFILE_KINDS) -> CodecContext:
    """A codec context for this side with what ``folder`` (``<store>/<pair>``) holds: the pair's
    SCD artifacts (``meta.json`` there) and the profiles of ``profiles`` beside it
    (``<store>/<pair>.<kind>.json``), checked against the fingerprints given. A method named in
    ``require`` whose artifacts or profile are missing is a ``ConfigError`` at start-up."""
    from shared.artifacts import store
    from shared.codecs.scd import PairArtifacts

    ctx = CodecContext(adapter)
    needs_art = [m for m in require if m in CODECS and "artifacts" in CODECS[m].requires]
    needs_prof = [m for m in require if m == "auto" or (m in CODECS and "profile" in CODECS[m].requires)]
    if folder is None:
        if needs_art or needs_prof:
            raise ConfigError(f"methods {needs_art + needs_prof} need the pair's calibration artifacts: set "
                              "artifact_store (or drop them from methods)")
        return ctx
    folder = Path(folder)
    if needs_art or (folder / "meta.json").exists():
        meta, tensors = store.load(folder, side, producer_fp, consumer_fp)
        ctx.artifacts = PairArtifacts(meta, tensors, side)
    for kind in profiles:
        if kind in needs_prof or profile_path(folder.parent, folder.name, kind).exists():
            ctx.profiles[kind] = store.load_profile(folder.parent, folder.name, kind, producer_fp, consumer_fp)
    return ctx
