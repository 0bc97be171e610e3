"""Helpers of the operations tests: the tiny character-level tokenizer with a chat template (so the
HTTP front can be driven by text with the tiny models), self-signed TLS material, a saved tiny
model folder a subprocess can serve, and bounded polling."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from shared.model.tiny import tiny_tokenizer  # noqa: F401  (re-exported for the operations tests)

VENV_BIN = Path(sys.executable).parent


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
    """A model folder ``scd serve`` can load."""
    from shared.model.tiny import save_pretrained

    return Path(save_pretrained(model, folder, tokenizer))


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
