"""A directory of calibration artifacts: ``<store>/<pair>/{meta.json, producer.safetensors,
consumer.safetensors}``. Writes are atomic (a temporary folder renamed into place); loads verify
every file's sha256 and the models' fingerprints, and refuse with a clear error, never falling
back silently. Nothing is pickled."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from shared.artifacts.meta import FORMAT_VERSION, ArtifactMeta
from shared.artifacts.profiles import PROFILE_FORMAT_VERSION, PROFILES, Profile
from shared.config import field_errors
from shared.errors import DataLoss, FingerprintMismatch, NotFound, PreconditionFailed
from shared.paths import profile_path

SIDES = ("producer", "consumer")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _umask_mode(path: Path) -> None:
    """Give a written file or folder the mode a plain ``open``/``mkdir`` would (temporary files and
    folders are private, 0600/0700): services running as another user (a container's non-root
    user, say) must be able to read a store that ``scd calibrate`` wrote."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def save(store: str | Path, meta: ArtifactMeta, producer: dict[str, torch.Tensor],
         consumer: dict[str, torch.Tensor]) -> Path:
    """Write one pair's artifacts atomically; returns the pair's folder."""
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    final = store / meta.pair
    tmp = Path(tempfile.mkdtemp(prefix=f".{meta.pair}.", dir=store))
    try:
        files = {}
        for side, tensors in (("producer", producer), ("consumer", consumer)):
            name = f"{side}.safetensors"
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / name)
            files[name] = _sha256(tmp / name)
        meta = meta.model_copy(update={"files": files})
        (tmp / "meta.json").write_text(meta.model_dump_json(indent=2) + "\n")
        for path in (tmp, *tmp.iterdir()):
            _umask_mode(path)
        old = None
        if final.exists():
            old = store / f".{meta.pair}.old"
            shutil.rmtree(old, ignore_errors=True)
            try:
                os.rename(final, old)
            except OSError as e:
                if e.errno not in (errno.EBUSY, errno.EXDEV):
                    raise
                _replace_files(tmp, final, (*files, "meta.json"))  # a volume mounted at <store>/<pair>
                return final
        os.rename(tmp, final)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _replace_files(tmp: Path, final: Path, names) -> None:
    """``final`` cannot be renamed (a mount point): each file is copied in beside its old one and
    renamed over it, meta.json last. A reader meanwhile may find a file whose hash its meta.json does
    not list (DataLoss: "recalibrate"), never a mix it takes for valid."""
    for name in names:
        part = final / f".{name}.part"
        shutil.copyfile(tmp / name, part)
        shutil.copymode(tmp / name, part)
        os.replace(part, final / name)
    shutil.rmtree(tmp, ignore_errors=True)


def load_meta(folder: str | Path) -> ArtifactMeta:
    folder = Path(folder)
    path = folder / "meta.json"
    if not path.exists():
        raise NotFound(f"no artifacts at {folder}: run `scd calibrate --pair {folder.name} --out {folder.parent}`")
    raw = path.read_bytes()
    try:
        found = json.loads(raw)
    except ValueError as e:
        raise DataLoss(f"{path} is not JSON ({e}): restore it or recalibrate the pair") from None
    if not isinstance(found, dict) or found.get("format_version") != FORMAT_VERSION:
        version = found.get("format_version") if isinstance(found, dict) else None
        raise PreconditionFailed(f"artifacts at {folder} have format {version!r}; this build reads {FORMAT_VERSION}: "
                                 "recalibrate or update the service")
    try:
        return ArtifactMeta.model_validate(found)  # its format_version checked above
    except ValidationError as e:
        raise PreconditionFailed(f"{path} is not a valid artifact manifest ({field_errors(e)[0]}): restore it or "
                                 "recalibrate the pair") from None


def load(folder: str | Path, side: str, producer_fingerprint: str | None = None,
         consumer_fingerprint: str | None = None) -> tuple[ArtifactMeta, dict[str, torch.Tensor]]:
    """One side's tensors, after checking the file hash and the model fingerprints given."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    folder = Path(folder)
    meta = load_meta(folder)
    name = f"{side}.safetensors"
    path = folder / name
    if name not in meta.files or not path.exists():
        raise NotFound(f"artifact file {path} is missing; recalibrate the pair")
    if _sha256(path) != meta.files[name]:
        raise DataLoss(f"artifact file {path} does not match the sha256 in its meta.json: it was modified or "
                       "corrupted; restore it or recalibrate")
    for who, want, have in (("producer", producer_fingerprint, meta.producer_fingerprint),
                            ("consumer", consumer_fingerprint, meta.consumer_fingerprint)):
        if want is not None and want != have:
            raise FingerprintMismatch(
                f"artifacts at {folder} were calibrated for {who} weights {have!r}, but the loaded {who} model is "
                f"{want!r}: load the right model or run `scd calibrate --pair {meta.pair}` (with --data PROMPTS.jsonl "
                "for a pair of your own)")
    return meta, load_file(path)


def save_profile(store_dir: str | Path, pair: str, kind: str, payload: dict, producer_fingerprint: str,
                 consumer_fingerprint: str, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A small JSON artifact of a baseline (e.g. DroidSpeak's recompute blocks), written atomically
    beside the pair's SCD artifacts: ``<store>/<pair>.<kind>.json``, pinned to both models. A baseline
    with weights (the ridge mapper) adds ``<pair>.<kind>.safetensors``, whose sha256 the JSON records."""
    store_dir = Path(store_dir)
    store_dir.mkdir(parents=True, exist_ok=True)
    path = profile_path(store_dir, pair, kind)
    body = {"pair": pair, "kind": kind, "format_version": PROFILE_FORMAT_VERSION,
            "producer_fingerprint": producer_fingerprint, "consumer_fingerprint": consumer_fingerprint, **payload}
    if tensors is not None:
        fd, tmp_t = tempfile.mkstemp(prefix=f".{pair}.{kind}.", suffix=".safetensors", dir=store_dir)
        os.close(fd)
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_t)
        body["tensors_sha256"] = _sha256(Path(tmp_t))
        _umask_mode(Path(tmp_t))
        os.replace(tmp_t, store_dir / f"{pair}.{kind}.safetensors")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=store_dir)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(body, indent=2) + "\n")
    _umask_mode(Path(tmp))
    os.replace(tmp, path)
    return path


PROFILE_NOT_SERVED = {"report", "data", "pin", "tensors"}
"""Profile fields that say how it was made (or are added at load), not what it serves: outside its pin."""


def profile_pin(body: dict) -> str:
    """The content hash of what a profile serves (``PROFILE_NOT_SERVED`` left out; a profile with maps
    carries their sha256): the stream header carries it, so both sides must hold the same profile,
    and an operating table's point measured with another is stale."""
    served = {k: v for k, v in body.items() if k not in PROFILE_NOT_SERVED}
    return hashlib.sha256(json.dumps(served, sort_keys=True, default=list).encode()).hexdigest()[:16]


def load_profile(store_dir: str | Path, pair: str, kind: str, producer_fingerprint: str | None = None,
                 consumer_fingerprint: str | None = None) -> dict:
    """A baseline's profile, validated against its kind's model (``profiles.py``) and pinned to the
    fingerprints given; ``pin`` is ``profile_pin``, ``tensors`` the maps when the profile has any."""
    path = profile_path(store_dir, pair, kind)
    if not path.exists():
        raise NotFound(f"no {kind} profile at {path}: run `scd calibrate --pair {pair} --method {kind}`")
    raw = path.read_bytes()
    try:
        found = json.loads(raw)
    except ValueError as e:
        raise DataLoss(f"{path} is not JSON ({e}): restore it or rerun `scd calibrate --pair {pair} --method "
                       f"{kind}`") from None
    if not isinstance(found, dict) or found.get("format_version") != PROFILE_FORMAT_VERSION:
        version = found.get("format_version") if isinstance(found, dict) else None
        raise PreconditionFailed(f"{path} has profile format {version!r}; this build reads {PROFILE_FORMAT_VERSION}: "
                                 f"rerun `scd calibrate --pair {pair} --method {kind}`")
    model = PROFILES.get(kind, Profile)
    try:
        body = model.model_validate(found).model_dump()
    except ValidationError as e:
        raise PreconditionFailed(f"{path} is not a valid {kind} profile ({field_errors(e)[0]}): rerun "
                                 f"`scd calibrate --pair {pair} --method {kind}`") from None
    body["pin"] = profile_pin(body)
    for who, want in (("producer", producer_fingerprint), ("consumer", consumer_fingerprint)):
        if want is not None and body.get(f"{who}_fingerprint") != want:
            raise FingerprintMismatch(f"{path} was profiled for {who} weights {body.get(f'{who}_fingerprint')!r}, "
                                      f"not {want!r}: rerun `scd calibrate --pair {pair} --method {kind}`")
    if "tensors_sha256" in body:
        tpath = path.with_suffix(".safetensors")
        if not tpath.exists():
            raise NotFound(f"{tpath} is missing: rerun `scd calibrate --pair {pair} --method {kind}`")
        if _sha256(tpath) != body["tensors_sha256"]:
            raise DataLoss(f"{tpath} does not match the sha256 in {path}: it was modified or corrupted; restore it "
                           f"or rerun `scd calibrate --pair {pair} --method {kind}`")
        body["tensors"] = load_file(tpath)
    return body
