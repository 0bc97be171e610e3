"""``scd calibrate --method fallback``: the fallback layers of ``scd`` and ``scd-reuse`` selected again on a
pair's existing artifacts (the producer's own int8 K/V on the layers where a code does worse on
validation), every candidate set scored by the served method itself.

The full search selects them once, among its other stages; this stage alone reruns that selection
(``tools.calibration.pipeline._fallback``: each layer alone, the best sets by gain, then the per-kind bound
``fallback_bound``) when what validation measures has changed, without refitting the codes. It was
added when LM validation text began to be scored on its own continuation instead of the Oracle's greedy
one (see ``selection.prepare_val``): the two disagree in sign for REUSE codes on plain text.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from shared.artifacts import store
from shared.artifacts.meta import ArtifactMeta
from shared.codecs import CodecContext, make_method
from shared.codecs.scd import PairArtifacts
from shared.model.hf_adapter import ModelAdapter
from tools.calibration import selection as sel
from tools.calibration.pipeline import _fallback
from tools.calibration.scoring import Scorer
from tools.calibration.settings import CalibrationSettings
from tools.calibration.spill import SpillDir

log = logging.getLogger(__name__)

MODES = {"scd": "fallback", "scd-reuse": "reuse_fallback"}
"""Each mode whose fallback set this stage selects, and its report key (``<key>_layers`` in the meta)."""


class ServedRun:
    """What the fallback selection needs of a calibration run (``cfg``, ``scorer``, ``L``, the block,
    ``raw_by_kind``, ``kl``), over the served method ``kind`` with the artifacts ``meta``/``prod``/``cons``."""

    def __init__(self, kind: str, producer: ModelAdapter, consumer: ModelAdapter, scorer: Scorer,
                 cfg: CalibrationSettings, meta: ArtifactMeta, prod: dict, cons: dict, raw_by_kind: dict):
        self.kind, self.producer, self.consumer, self.scorer, self.cfg = kind, producer, consumer, scorer, cfg
        self.meta, self.prod, self.cons, self.raw_by_kind = meta, prod, cons, raw_by_kind
        self.L = consumer.n_layers
        self.chosen_block = tuple(meta.patch_blocks[0]) if kind == "scd" and meta.patch_blocks else None
        self.exit_kv = meta.block_exit_kv

    def with_fallback(self, layers: Sequence[int]) -> ArtifactMeta:
        return self.meta.model_copy(update={f"{MODES[self.kind]}_layers": sorted(layers)})

    def kl(self, fallback: Sequence[int] = (), **_: Any) -> float:
        """Validation KL of the served method with the producer's own K/V on the ``fallback`` layers."""
        meta = self.with_fallback(fallback)
        enc = make_method(self.kind, CodecContext(self.producer, PairArtifacts(meta, self.prod, "producer")))
        dec = make_method(self.kind, CodecContext(self.consumer, PairArtifacts(meta, self.cons, "consumer")))
        return self.scorer.kl(enc, dec)


def reselect(producer: ModelAdapter, consumer: ModelAdapter, folder: Path, out: Path, val: list[tuple],
             kinds: Sequence[str], cfg: CalibrationSettings, modes: Sequence[str], stop_ids: Sequence[int] = (),
             producer_fingerprint: str | None = None, consumer_fingerprint: str | None = None,
             progress: bool = True) -> tuple[Path, dict]:
    """Select the fallback layers of each of ``modes`` again on the validation prompts ``val`` (of text
    ``kinds``) and write the artifacts back into store ``out``; returns (folder, report)."""
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"fallback modes must be some of {sorted(MODES)}; got {list(modes)}")
    meta, prod = store.load(folder, "producer", producer_fingerprint, consumer_fingerprint)
    _, cons = store.load(folder, "consumer", producer_fingerprint, consumer_fingerprint)
    t0 = time.perf_counter()
    spill = SpillDir(cfg.spill_dir)
    rep: dict = {"n_val": len(val), "val_tokens": cfg.val_tokens, "kinds": dict(Counter(kinds)),
                 "scoring": "LM text on its held-out continuation, other text on the Oracle's greedy answer"}
    try:
        vps = sel.prepare_val(producer, consumer, val, n_new=cfg.val_tokens, progress=progress,
                              stop_ids=stop_ids, spill_to=spill)
        scorer = Scorer(producer, consumer, vps, list(kinds))
        rep["raw_kl"] = scorer.kl(*scorer.pair("raw"))
        rep["raw_by_kind"] = raw_by_kind = dict(scorer.last_by_kind)
        for mode in modes:
            run = ServedRun(mode, producer, consumer, scorer, cfg, meta, prod, cons, raw_by_kind)
            key = MODES[mode]
            before = getattr(meta, f"{key}_layers")
            rep[f"{key}_before"] = {"layers": list(before), "kl": run.kl(before),
                                    "by_kind": dict(scorer.last_by_kind)}
            kw = {"no_block": True} if mode == "scd-reuse" else {"patch_layers": list(meta.patch_layers)}
            chosen, _ = _fallback(run, rep, key, progress, **kw)  # type: ignore[arg-type]
            meta = run.with_fallback(chosen)
    finally:
        spill.cleanup()
    rep["seconds"] = round(time.perf_counter() - t0, 1)
    new = meta.model_copy(update={"report": {**meta.report, "refallback": rep}})
    return store.save(out, new, prod, cons), rep
