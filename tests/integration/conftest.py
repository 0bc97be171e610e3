"""Fixtures of the operations, faults and hardening tests: a tiny model, its tokenizer and the
services of ``ops_common.ops_services`` (one instance per test module)."""

import pytest
from ops_common import ops_services
from ops_support import tiny_tokenizer

from shared.model.tiny import tiny_model


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama", n_layers=4)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def svc(base, tok):
    with ops_services(base, tok) as s:
        yield s
