import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def real_assets():
    """The prepared SmolLM2 pair and data (``scd assets``); skips with the command to run if absent."""
    from shared import data
    from shared.assets.models import PAIRS, consumer_dir, is_ready, producer_dir

    missing = [p for p in [producer_dir(), *(consumer_dir(x) for x in PAIRS)] if not is_ready(p)]
    if missing or not data.is_ready():
        pytest.skip(f"real assets not prepared ({missing or 'data'}); run `scd assets`")
    return True


@pytest.fixture(scope="session")
def tokenizer(real_assets):
    from shared.assets.models import load_tokenizer

    return load_tokenizer()
