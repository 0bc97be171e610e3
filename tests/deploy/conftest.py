"""The deploy tests' fixtures: the image ``make image`` built, and one bearer token file for all."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from deploy_support import IMAGE, sh


@pytest.fixture(scope="session")
def token_file(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("secret") / "scd-token"
    f.write_text(secrets.token_hex(32) + "\n")
    f.chmod(0o644)  # a compose file secret is a bind mount: the image's unprivileged user must read it
    return f


@pytest.fixture(scope="session", autouse=True)
def image():
    r = sh("docker", "image", "inspect", IMAGE, check=False)
    if r.returncode:
        pytest.fail(f"image {IMAGE} not found: run `make image` first ({r.stderr.strip()})")
    return IMAGE
