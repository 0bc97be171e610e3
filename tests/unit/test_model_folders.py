"""A model folder's weights are the files transformers loads (``model.safetensors``, or the shards its
index names), and an adapter covers the layers of the base it is registered on. Each case here was
registered before (a stale file beside the shards, a shard gone, an adapter of a shallower base)."""

import shutil

import pytest
import torch

from shared.errors import SCDError
from shared.model.loading import folder_fingerprint, load_model, model_shapes
from shared.model.tiny import save_pretrained, tiny_model, tiny_tokenizer
from tools.assets.registry import check_pair


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The same tiny model saved whole and in shards, and its producer folder."""
    root = tmp_path_factory.mktemp("shards")
    model, tok = tiny_model("llama", n_layers=2), tiny_tokenizer()
    whole = save_pretrained(model, root / "whole", tok)
    model.save_pretrained(root / "shards", max_shard_size="20KB")
    tok.save_pretrained(root / "shards")
    return root, whole, root / "shards"


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_weights_are_the_ones_the_index_names(sharded):
    _, whole, shards = sharded
    assert len(list(shards.glob("model-*.safetensors"))) > 1, "the fixture did not shard"
    assert model_shapes(shards) == model_shapes(whole)
    assert folder_fingerprint(shards) == folder_fingerprint(whole)  # how the weights are split does not count
    check_pair(shards, shards.parent / "whole")


def test_a_stale_single_file_beside_the_shards_is_refused(sharded, tmp_path):
    """transformers loads model.safetensors when both are there and ignores the shards."""
    _, whole, shards = sharded
    both = _copy(shards, tmp_path / "both")
    stale = tiny_model("llama", n_layers=2)
    with torch.no_grad():
        for p in stale.parameters():
            p.add_(1.0)
    stale.save_pretrained(tmp_path / "stale")
    shutil.copy(tmp_path / "stale" / "model.safetensors", both / "model.safetensors")
    for call in (lambda: check_pair(both, whole), lambda: load_model(both)):
        with pytest.raises(SCDError, match="holds both model.safetensors and the shards .* Remove whichever is stale"):
            call()


def test_a_missing_shard_is_named(sharded, tmp_path):
    _, whole, shards = sharded
    gone = _copy(shards, tmp_path / "gone")
    first = sorted(gone.glob("model-*.safetensors"))[0]
    first.unlink()
    with pytest.raises(SCDError, match=rf"1 of the \d+ shards its model.safetensors.index.json names are not there "
                                        rf"\({first.name}\)"):
        check_pair(gone, whole)


def test_shards_without_their_index_are_named(sharded, tmp_path):
    _, whole, shards = sharded
    bare = _copy(shards, tmp_path / "bare")
    (bare / "model.safetensors.index.json").unlink()
    with pytest.raises(SCDError, match="has model-0+1-of-.* but no model.safetensors.index.json"):
        check_pair(bare, whole)


def test_an_index_naming_a_file_outside_the_folder_is_refused(sharded, tmp_path):
    _, whole, shards = sharded
    bad = _copy(shards, tmp_path / "bad")
    index = bad / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"model-0', '"../model-0', 1))
    with pytest.raises(SCDError, match="a shard is a .safetensors file in the same folder"):
        check_pair(bad, whole)


def _adapter(path, n_layers, **lora):
    from peft import LoraConfig, get_peft_model

    get_peft_model(tiny_model("llama", n_layers=n_layers), LoraConfig(r=4, **lora)).save_pretrained(path)
    return path


def test_an_adapter_of_a_shallower_base_is_refused(tmp_path):
    """Its tensors fit the deeper base one by one; peft would leave the last layer as it is."""
    base = save_pretrained(tiny_model("llama", n_layers=4), tmp_path / "base", tiny_tokenizer())
    shallow = _adapter(tmp_path / "shallow", 3, target_modules=["q_proj", "v_proj"])
    with pytest.raises(SCDError, match=r"adapts self_attn.q_proj in 3 of the producer's 4 layers \(not layer 3\)"):
        check_pair(base, adapter=shallow)
    # an adapter that limits its layers, or one of the same depth, registers
    assert check_pair(base, adapter=_adapter(tmp_path / "some", 4, target_modules=["q_proj"],
                                             layers_to_transform=[1, 2]))["adapter"]
    assert check_pair(base, adapter=_adapter(tmp_path / "all", 4, target_modules=["q_proj"]))["adapter"]
