"""Helpers of the operations tests: a tiny character-level tokenizer with a chat template (so the
HTTP front can be driven by text with the tiny models), self-signed TLS material, a saved tiny
model folder a subprocess can serve, and bounded polling."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """256 ids, like the tiny models: 3 special tokens, printable ASCII and newline, then filler
    characters, so that every id the model can emit decodes to one character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    chars += [chr(0x100 + i) for i in range(256 - len(specials) - len(chars))]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=specials[1:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def wait_for(cond, timeout: float = 20.0, every: float = 0.05, what: str = "condition"):
    """Poll ``cond()`` until truthy; fail the test after ``timeout`` seconds (never hangs)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def save_tiny(folder: Path, model, tokenizer=None) -> Path:
    """A model folder ``scd serve`` can load (the ready marker of shared.assets.models included)."""
    from shared.assets import models as M

    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    (folder / M._DONE).write_text("ok\n")
    return folder


def self_signed(folder: Path) -> dict[str, str] | None:
    """A self-signed certificate for 127.0.0.1/localhost (its own CA) made with the openssl CLI, or
    None when openssl is absent."""
    import shutil

    if shutil.which("openssl") is None:
        return None
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-addext",
                    "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=digitalSignature,keyCertSign",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return {"key": str(key), "cert": str(cert)}


def env() -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return e
