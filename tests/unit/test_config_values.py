"""What a settings or request error quotes of the value it refuses."""

import pytest

from consumer_service.settings import ConsumerSettings
from shared.errors import ConfigError


def test_a_value_of_the_wrong_type_is_quoted_but_a_token_is_not(tmp_path):
    """"should be a valid number" did not say which value a request or a file gave; a secret given as a
    number (YAML reads `token: 1234` as one) must not be echoed into an error or a log."""
    from shared.codecs import check_settings
    from shared.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=r"block_tokens: .*valid number.* \(got 'true'\)"):
        check_settings("scd", {"block_tokens": "true"})
    with pytest.raises(InvalidRequest, match=r"\(got 'xxxxx.*\.\.\. \(300 characters\)\)"):
        check_settings("scd", {"block_tokens": "x" * 300})
    f = tmp_path / "c.yaml"
    f.write_text("model: {path: m}\nsecurity: {token: 987654321}\nframe_timeout_s: soon\n")
    with pytest.raises(ConfigError) as e:
        ConsumerSettings.load(f)
    said = str(e.value)
    assert "frame_timeout_s: Input should be a valid number" in said and "(got 'soon')" in said, said
    assert "security.token" in said and "987654321" not in said, said


def test_a_default_deadline_over_the_longest_allowed_is_refused_at_start():
    """900 s by default with requests cut to 600: the default never applied, without a word."""
    from producer_service.settings import ProducerSettings

    with pytest.raises(ConfigError, match=r"default_deadline_s \(900\) is over max_deadline_s \(600\)"):
        ProducerSettings.load(overrides=["model.path=/x", "default_deadline_s=900"])
    assert ProducerSettings.load(overrides=["model.path=/x", "default_deadline_s=600"]).default_deadline_s == 600


@pytest.mark.parametrize("override", ["server.port.x=3", "server.port.x.y=3", "http.port.z=1"])
def test_a_set_under_a_plain_value_is_a_config_error(override):
    with pytest.raises(ConfigError, match=r"is a setting of its own, not a section"):  # was a TypeError traceback
        ConsumerSettings.load(overrides=["http.port=9090", override], model={"path": "m"})
