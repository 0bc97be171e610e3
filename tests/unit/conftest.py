"""Fixtures several unit test modules share."""

import pickle

import pytest
import torch

from shared.model.tiny import perturbed, save_pretrained, tiny_config, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny llama producer and its fine-tune as two operator folders, a LoRA adapter folder on the
    producer, and a few broken folders."""
    root = tmp_path_factory.mktemp("models")
    base = tiny_model("llama", n_layers=2)
    tok = tiny_tokenizer()
    out = {"producer": save_pretrained(base, root / "base", tok),
           "consumer": save_pretrained(perturbed(base, 0.2), root / "ft", tok),
           "qwen": save_pretrained(tiny_model("qwen2", n_layers=2), root / "qwen", tok),
           "deeper": save_pretrained(tiny_model("llama", n_layers=3), root / "deeper", tok),
           "other_vocab": save_pretrained(perturbed(base, 0.2), root / "other_vocab", tiny_tokenizer(seed=3))}
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(tiny_model("llama", n_layers=2),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    lora.save_pretrained(root / "adapter")
    out["adapter"] = str(root / "adapter")
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama", n_layers=2)
    cfg.hidden_size, cfg.head_dim = 96, 24  # another base model: the adapter's widths do not fit
    wide = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=4, target_modules=["q_proj"]))
    wide.save_pretrained(root / "wide_adapter")
    out["wide_adapter"] = str(root / "wide_adapter")
    # pickle-only weights whose unpickling would leave a mark: proves they are never unpickled
    pk = root / "pickled"
    pk.mkdir()
    (pk / "config.json").write_text((root / "base" / "config.json").read_text())
    marker = root / "UNPICKLED"

    class Bomb:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (pk / "pytorch_model.bin").write_bytes(pickle.dumps(Bomb()))
    out["pickled"], out["marker"] = str(pk), marker
    gpt2 = root / "gpt2"
    from transformers import GPT2Config, GPT2LMHeadModel

    save_pretrained(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256)), gpt2, tok)
    out["gpt2"] = str(gpt2)
    return out
