"""A tiny pair of any supported family, calibrated for every registered method with the real
calibration code at small settings: SCD artifacts and the DroidSpeak, SpectrumKV and ridge profiles
written into an artifact store, as ``scd calibrate`` writes them. Used by tests (each family through
the real services) and by the smoke benchmarks."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.model.hf_adapter import ModelAdapter


def random_prompts(n: int, length: int, seed: int, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, vocab, (length,), generator=g).tolist() for _ in range(n)]


def calibrate_all(producer: ModelAdapter, consumer: ModelAdapter, name: str, store_dir: str | Path,
                  cal: list[list[int]] | None = None, val: list[tuple[list[int], int]] | None = None,
                  stop_ids=()) -> Path:
    """Calibrate SCD (with a 2-layer PATCH block and one PATCH layer) and profile droidspeak,
    spectrum and ridge for the pair into ``store_dir``; returns the store."""
    from shared.artifacts import store
    from shared.model.fingerprint import weights_fingerprint
    from tools.calibration.droidspeak import profile
    from tools.calibration.pipeline import CalibrationSettings, calibrate
    from tools.calibration.ridge import calibrate as fit_ridge
    from tools.calibration.spectrum import probe

    store_dir = Path(store_dir)
    cal = cal or random_prompts(12, 40, 11)
    val = val or [(p, 0) for p in random_prompts(3, 36, 12)]
    n = producer.n_layers
    cfg = CalibrationSettings(pair=name, n_prompts=len(cal), reuse_code="joint", r_kv=48, r_h=32, budget_k=1, pool=2,
                              n_val=len(val), val_tokens=8, aligner_hidden=32, aligner_steps=40, aligner_rows=256,
                              ablations=False, block_layers=min(2, n - 1))
    calibrate(producer, consumer, cal, val, cfg, str(store_dir), "tiny", progress=False, stop_ids=stop_ids)
    pfp, cfp = weights_fingerprint(producer.model), weights_fingerprint(consumer.model)
    ds = profile(producer, consumer, val, budget_layers=min(2, n - 1), block_len=min(2, n - 1), n_val=len(val),
                 progress=False, stop_ids=stop_ids)
    store.save_profile(store_dir, name, "droidspeak", ds, pfp, cfp)
    store.save_profile(store_dir, name, "spectrum", probe(producer, consumer, val, trials=2, n_new=8, progress=False),
                       pfp, cfp)
    tensors, prof = fit_ridge(producer, consumer, cal, val, top_ks=(1,), alphas=(1e-2,), n_val=len(val),
                              progress=False, stop_ids=stop_ids)
    store.save_profile(store_dir, name, "ridge", prof, pfp, cfp, tensors=tensors)
    return store_dir
