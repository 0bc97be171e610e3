"""The vLLM connector's kv_connector_extra_config, per role: every key checked when the engine starts
(a typo was ignored and the default address used; a wrong value failed later, or never)."""

import pytest

from integrations.vllm_connector.settings import ConsumerExtra, ProducerExtra, parse_extra


def test_each_role_takes_its_documented_settings():
    p = parse_extra("kv_producer", {"consumer": "10.0.0.2:50161", "consumers": {"strong": "10.0.0.2:50161"},
                                    "method": "quant", "method_params": {"bits": 4, "residual": 0},
                                    "artifacts": "artifacts/store/strong", "timeout_s": 30, "stats_file": "/tmp/s"})
    assert isinstance(p, ProducerExtra) and p.params() == {"bits": "4", "residual": "0"} and p.timeout_s == 30
    c = parse_extra("kv_consumer", {"listen": "0.0.0.0:50161", "methods": ["raw", "scd-reuse"], "ttl_s": 60,
                                    "max_held_bytes": "512MiB", "frame_timeout_s": 5, "producer_fingerprint": "ab"})
    assert isinstance(c, ConsumerExtra) and c.max_held_bytes == 512 << 20 and c.methods == ("raw", "scd-reuse")
    assert parse_extra("kv_consumer", None).listen == "127.0.0.1:50061"  # none given: the defaults
    assert p.default() == ("quant", {"bits": "4", "residual": "0"})
    # a method with settings, as the CLI and the services take it (was "unknown method 'quant:bits=4'")
    v = parse_extra("kv_producer", {"method": "quant:bits=4", "method_params": {"residual": 0}})
    assert isinstance(v, ProducerExtra) and v.default() == ("quant", {"bits": "4", "residual": "0"})


@pytest.mark.parametrize("role, extra, said", [
    ("kv_producer", {"consumr": "10.0.0.2:50161"}, "consumr: not a known setting (its settings: artifacts,"),
    ("kv_producer", {"listen": "0.0.0.0:1"}, "listen: not a known setting"),  # the other role's key
    ("kv_consumer", {"load_timeout_s": 5}, "load_timeout_s: not a known setting"),
    ("kv_producer", {"method": "scd"}, "method 'scd' cannot run in the vLLM connector: its PATCH block"),
    ("kv_producer", {"method": "rwa"}, "unknown method 'rwa'; the vLLM connector runs ['raw', 'quant', 'scd-reuse']"),
    ("kv_consumer", {"methods": ["raw", "ridge"]}, "methods: method 'ridge' cannot run in the vLLM connector"),
    ("kv_consumer", {"methods": []}, "methods: name at least one method"),
    ("kv_producer", {"consumer": "10.0.0.2"}, "consumer: address '10.0.0.2' must be HOST:PORT"),
    ("kv_producer", {"consumers": {"a b": "h:1"}}, "consumer name(s) 'a b' must be 1-63 characters"),
    ("kv_consumer", {"listen": "0.0.0.0:99999"}, "listen: address '0.0.0.0:99999' must be HOST:PORT (port 1-65535)"),
    ("kv_producer", {"timeout_s": 0}, "timeout_s: Input should be greater than 0"),
    ("kv_consumer", {"ttl_s": True}, "ttl_s: Input should be a valid number"),  # not 1 second
    ("kv_consumer", {"max_held_bytes": "2g"}, "'2g' is ambiguous"),
    ("kv_producer", {"method_params": {"bits": [4]}}, "method_params.bits: send a string, number or boolean"),
    ("kv_producer", {"method": "raw:dtype"}, "method: method variant 'raw:dtype': settings are KEY=VALUE"),
    ("kv_producer", {"method": "scd:block_tokens=0.35"}, "method 'scd' cannot run in the vLLM connector"),
    ("kv_producer", {"method": "quant:bits=4", "method_params": {"bits": 8}}, "method 'quant:bits=4' sets bits=4 and "
                                                                              "method_params sets bits='8'; give each"),
])
def test_a_setting_the_role_does_not_take_is_named(role, extra, said):
    with pytest.raises(ValueError) as e:
        parse_extra(role, extra)
    assert "[str" not in str(e.value) and ".str" not in str(e.value)  # no union branch's type name
    assert said in str(e.value) and f"SCDConnector ({role}): kv_connector_extra_config: " in str(e.value), str(e.value)
