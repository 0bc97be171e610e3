import logging
import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

ASYNC_FAULTS = ("Task was destroyed but it is pending", "is bound to a different event loop",
                "Task exception was never retrieved")
"""What asyncio logs of a task that outlived its request (issue 58): never, anywhere in the suite."""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = ("consumer_service", "producer_service", "shared", "tools", "integrations", "tests")


class _AsyncFaults(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if not any(f in msg for f in ASYNC_FAULTS):
            return
        text = logging.Formatter().format(record)  # with the traceback: where the task came from
        if any(f"{ROOT}/{pkg}/" in text for pkg in OURS):  # a library's own (vLLM's, say) is not ours to fail on
            self.seen.append(msg.splitlines()[0][:300])


_ASYNC_FAULTS = _AsyncFaults()
logging.getLogger("asyncio").addHandler(_ASYNC_FAULTS)


HEAVY_FIXTURES = {"real_assets", "tokenizer", "tiny_artifacts", "tiny_droidspeak", "tiny_spectrum", "tiny_ridge"}
"""Fixtures that load the real model or run a calibration: a test that uses one is not in the fast tier."""


def pytest_collection_modifyitems(config, items):
    """Tiers: a test is ``fast`` (``make test-fast``) unless it is an integration test, is marked
    real/slow/gpu/deploy/vllm, uses a fixture of ``HEAVY_FIXTURES``, or is named in ``NOT_FAST``."""
    for item in items:
        path = str(item.fspath)
        heavy = ("/tests/unit/" not in path or any(item.get_closest_marker(m) for m in
                                                     ("real", "slow", "gpu", "deploy", "vllm"))
                 or HEAVY_FIXTURES & set(getattr(item, "fixturenames", ()))
                 or any(path.endswith(f"/{name}") or item.nodeid.endswith(f"/{name}") for name in NOT_FAST))
        if not heavy:
            item.add_marker(pytest.mark.fast)


NOT_FAST = ("test_scd_fallback.py", "test_heldout.py", "test_refallback.py", "test_fast_calibration.py",
            "test_entry_map.py", "test_calibration_aligner.py", "test_code_levels.py", "test_anatomy.py",
            "test_sparse_block.py", "test_codec_contract.py", "test_block_guard.py",
            # reads the built-in pair's registration (scd assets), not its weights
            "test_config.py::test_calibrate_names_every_setting_the_pairs_model_cannot_take_before_loading_it")
"""Unit test modules (or ``module::test``) that calibrate, load models or read the assets themselves
(found with --durations and with an empty SCD_HOME): not in the fast tier."""


def pytest_sessionfinish(session, exitstatus):
    """The suite fails if asyncio said, at any time (garbage collection included), that a task was left."""
    import gc

    gc.collect()
    if _ASYNC_FAULTS.seen:
        print(f"\n{len(_ASYNC_FAULTS.seen)} asyncio fault(s) in the suite's logs (a task outlived its request):")
        for m in _ASYNC_FAULTS.seen[:10]:
            print("  ", m)
        session.exitstatus = 1


@pytest.fixture(scope="session")
def real_assets():
    """The prepared SmolLM2 pair and data (``scd assets``); skips with the command to run if absent."""
    from tools import data
    from tools.assets import registry
    from tools.assets.models import PAIRS, consumer_dir, is_ready, producer_dir

    missing = [p for p in [producer_dir(), *(consumer_dir(x) for x in PAIRS)] if not is_ready(p)]
    if missing or not data.is_ready() or any(p not in registry.names() for p in PAIRS):
        pytest.skip(f"real assets not prepared ({missing or 'data or pair registrations'}); run `scd assets`")
    return True


@pytest.fixture(scope="session")
def tokenizer(real_assets):
    from tools.assets.models import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny_pair():
    """A tiny producer and a 'fine-tuned' consumer whose layer 2 attention projections differ."""
    from shared.model.hf_adapter import ModelAdapter
    from shared.model.tiny import tiny_model

    base = tiny_model("llama", n_layers=4)
    cons = tiny_model("llama", n_layers=4)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name in ("k_proj", "v_proj"):
            w = getattr(cons.model.layers[2].self_attn, name).weight
            w.add_(torch.randn(w.shape, generator=g) * w.abs().mean() * 3)
    return ModelAdapter(base), ModelAdapter(cons)


@pytest.fixture(scope="session")
def tiny_artifacts(tiny_pair, tmp_path_factory):
    """Calibrated SCD artifacts for the tiny pair (the real pipeline, small settings)."""
    from tools.calibration.pipeline import CalibrationSettings, calibrate

    producer, consumer = tiny_pair
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (48,), generator=g).tolist() for _ in range(24)]
    val = [(torch.randint(0, 256, (40,), generator=g).tolist(), 0) for _ in range(4)]
    cfg = CalibrationSettings(pair="tiny", n_prompts=20, reuse_code="separate", r_k=16, r_v=24, r_h=32, budget_k=1,
                              pool=4, n_val=4,
                              aligner_hidden=64, aligner_steps=150, aligner_rows=900, ablations=False,
                              block_layers=0)
    out = tmp_path_factory.mktemp("store")
    folder, report = calibrate(producer, consumer, prompts, val, cfg, str(out), "test", progress=False)
    return folder, report


@pytest.fixture(scope="session")
def tiny_droidspeak(tiny_pair):
    """DroidSpeak's recompute blocks profiled on the tiny pair (the real profiler, small settings)."""
    from tools.calibration.droidspeak import profile

    producer, consumer = tiny_pair
    g = torch.Generator().manual_seed(12)
    val = [(torch.randint(0, 256, (40,), generator=g).tolist(), 0) for _ in range(3)]
    return profile(producer, consumer, val, budget_layers=2, block_len=2, n_val=3, progress=False)


@pytest.fixture(scope="session")
def tiny_spectrum(tiny_pair):
    """SpectrumKV's int4 probe run on the tiny pair (the real probe)."""
    from tools.calibration.spectrum import probe

    producer, consumer = tiny_pair
    g = torch.Generator().manual_seed(13)
    val = [(torch.randint(0, 256, (40,), generator=g).tolist(), 0) for _ in range(3)]
    return probe(producer, consumer, val, progress=False)


@pytest.fixture(scope="session")
def tiny_ridge(tiny_pair):
    """The cross-model ridge maps calibrated on the tiny pair (the real calibration, small grid)."""
    from tools.calibration.ridge import calibrate

    producer, consumer = tiny_pair
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(0, 256, (48,), generator=g).tolist() for _ in range(24)]
    val = [(torch.randint(0, 256, (40,), generator=g).tolist(), 0) for _ in range(4)]
    tensors, payload = calibrate(producer, consumer, prompts, val, top_ks=(1, 2), alphas=(1e-2,), n_val=4,
                                 progress=False)
    return {**payload, "tensors": tensors}


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """A registry and a home of the test's own (SCD_HOME, SCD_PAIRS under tmp_path; no SCD_STORE)."""
    monkeypatch.setenv("SCD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SCD_PAIRS", str(tmp_path / "home" / "pairs.json"))
    monkeypatch.delenv("SCD_STORE", raising=False)
    return tmp_path
