"""Method settings that validate but that this model or pair cannot take, found when the method is
made (``make_method``): worded as the validation's errors, naming the setting."""

import pytest

from shared.artifacts import store
from shared.codecs import CodecContext, make_method, method_config
from shared.codecs.scd import PairArtifacts
from shared.errors import InvalidRequest


@pytest.fixture(scope="module")
def contexts(tiny_pair, tiny_artifacts):
    producer, _ = tiny_pair
    folder, _ = tiny_artifacts
    meta, pt = store.load(folder, "producer")
    return (CodecContext(producer, PairArtifacts(meta, pt, "producer")),)


@pytest.mark.parametrize("kind,params,param,says", [
    ("droidspeak", {"blocks": "3-1"}, "blocks", "block 3-1 holds no layer"),
    ("droidspeak", {"blocks": "1-99"}, "blocks", "outside the model's 4 layers"),
    ("droidspeak", {"blocks": "0-2,1-3"}, "blocks", "0-2, 1-3 overlap"),
    ("droidspeak", {"blocks": "[[0, 1, 2]]"}, "blocks", "a block is two layer numbers"),
    ("droidspeak", {"blocks": "2"}, "blocks", "write blocks as FIRST-END"),
    ("droidspeak", {"blocks": "[2]"}, "blocks", "write blocks as FIRST-END"),
    ("droidspeak", {"blocks": "a-b"}, "blocks", "write blocks as FIRST-END"),
    ("quant", {"group_size": "7"}, "group_size", "7 does not divide the model's K/V width"),
    ("scd", {"patch_layers": "9"}, "patch_layers", "layers [9] were not calibrated"),
    ("scd", {"patch_layers": "x"}, "patch_layers", "write layer numbers separated by commas"),
    ("scd", {"patch_layers": '["a"]'}, "patch_layers", "write layer numbers separated by commas"),
    # it was served as scd without the block (and measured as such, under its own label)
    ("scd", {"block_tokens": "0.35", "patch_blocks": "none"}, "block_tokens", "and patch_blocks=none was given"),
])
def test_a_setting_this_model_or_pair_cannot_take_is_named_with_its_form(contexts, kind, params, param, says):
    """Settings that validate but that the model or pair cannot take (checked when the method is made)
    read like the validation's own errors and name the setting in ``param``: they had no param, and
    some said only 'is outside 0..30' for a reversed block, or Python's 'invalid literal for int()'."""
    with pytest.raises(InvalidRequest) as ei:
        make_method(kind, contexts[0], params)
    msg = str(ei.value)
    assert msg.startswith(f"invalid settings for method {kind!r}: {param}: "), msg
    assert says in msg and "invalid literal" not in msg, msg
    assert ei.value.param == param


def test_one_patch_layer_may_be_given_as_a_number(contexts):
    layer = contexts[0].artifacts.meta.patch_layers[0]
    assert make_method("scd", contexts[0], {"patch_layers": str(layer)}).patch == {layer}
    assert method_config("scd", {}).model_validate({"kind": "scd", "patch_layers": layer}).patch_layers == [layer]


def test_a_sparse_block_on_a_pair_without_a_block_is_refused(contexts):
    """It was served as ``scd`` itself (and measured so, under its own label). Pairs with a block serve
    it: tests/unit/test_sparse_block.py."""
    ctx = contexts[0]
    assert not ctx.artifacts.meta.patch_blocks, "the tiny pair is calibrated without a block"
    assert not make_method("scd", ctx).blocks  # the method itself serves
    with pytest.raises(InvalidRequest, match=r"block_tokens: 0.35 is the share .* the 'tiny' calibration has no PATCH "
                                             r"block; leave block_tokens out") as ei:
        make_method("scd", ctx, {"block_tokens": "0.35"})
    assert ei.value.param == "block_tokens"


def test_a_setting_given_in_the_label_and_beside_it_conflicts_only_when_the_values_differ():
    from shared.codecs import resolve_variant

    for a, b in (("0.35", "0.350"), ("1", "1.0"), ("true", "True"), ("float16", "float16")):
        assert resolve_variant(f"scd:block_tokens={a}", {"block_tokens": b}) == ("scd", {"block_tokens": b})
    for a, b in (("0.35", "0.5"), ("1", "true"), ("float16", "float32"), ("[1, 2]", "[1,3]")):
        with pytest.raises(InvalidRequest, match="give each setting once") as e:
            resolve_variant(f"scd:block_tokens={a}", {"block_tokens": b})
        assert e.value.param == "method_params"


@pytest.mark.parametrize("given", ["0,0", "[3, 4, 3]", "2, 2"])
def test_a_layer_named_twice_is_refused_naming_it(given):
    from shared.codecs import check_settings

    with pytest.raises(InvalidRequest, match=r"patch_layers: layer\(s\) \d given twice; name each layer once") as e:
        check_settings("scd", {"patch_layers": given})
    assert e.value.param == "patch_layers"
