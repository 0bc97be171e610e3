"""A list setting written as one text, as an environment variable or `--set` gives it: `raw,scd`
or `*` was refused ("Input should be a valid tuple; write a list, e.g. [a, b]")."""

from __future__ import annotations

import pytest

from consumer_service.settings import ConsumerSettings
from producer_service.settings import ProducerSettings
from shared.errors import ConfigError

BASE = ["consumers.strong.address=127.0.0.1:1", "model.path=/m", "default_method=raw"]


@pytest.mark.parametrize("given,methods", [("raw", ("raw",)), ("raw, scd", ("raw", "scd")),
                                           ("[raw, oracle]", ("raw", "oracle"))])
def test_methods_as_text_or_as_a_list(given, methods):
    assert ProducerSettings.load(overrides=[*BASE, f"methods={given}"]).methods == methods


def test_list_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("PRODUCER__HTTP__CORS_ORIGINS", "https://a.example.com, http://localhost:3000")
    assert ProducerSettings.load(overrides=BASE).http.cors_origins == ("https://a.example.com",
                                                                       "http://localhost:3000")
    monkeypatch.setenv("PRODUCER__HTTP__CORS_ORIGINS", "*")
    assert ProducerSettings.load(overrides=BASE).http.cors_origins == ("*",)
    monkeypatch.setenv("CONSUMER__METHODS", "raw,quant")
    assert ConsumerSettings.load(overrides=["model.path=/m", "name=x"]).methods == ("raw", "quant")


def test_each_item_is_still_checked():
    with pytest.raises(ConfigError, match="'bogus' is not a transfer method"):
        ProducerSettings.load(overrides=[*BASE, "methods=raw,bogus"])
    with pytest.raises(ConfigError, match="name at least one method"):
        ProducerSettings.load(overrides=[*BASE, "methods=,"])
    with pytest.raises(ConfigError, match="origin.*'https://a.example.com/'"):
        ProducerSettings.load(overrides=[*BASE, "http.cors_origins=https://a.example.com/,*"])
