"""Publishing the committed artifact store into a shared one (a volume both services mount).

A Docker named volume starts as a copy of the image's folder, but only once: a volume made by an
older image keeps the older artifacts; a Kubernetes PVC starts empty. ``scd assets --store DIR``
(the assets job, the init container) therefore copies the built-in pairs' committed artifacts
into ``DIR`` file by file, replacing a file only when its bytes differ, each write atomic (a
temporary file, then a rename), so services reading the store never see half a file. Files in
``DIR`` that the committed store does not have (an operator's own pairs) are left alone.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import tempfile
from pathlib import Path

from shared.paths import STORE_DIR


def publish(dest: str | Path, source: Path = STORE_DIR) -> tuple[int, int]:
    """Copy ``source`` into ``dest`` where it differs; returns (files written, files already current)."""
    dest, written, current = Path(dest), 0, 0
    if dest.resolve() == source.resolve():
        return 0, sum(1 for p in source.rglob("*") if p.is_file())
    for src in sorted(p for p in source.rglob("*") if p.is_file()):
        out = dest / src.relative_to(source)
        if out.is_file() and filecmp.cmp(src, out, shallow=False):
            current += 1
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
        try:
            with os.fdopen(fd, "wb") as f, src.open("rb") as r:
                shutil.copyfileobj(r, f)
            os.chmod(tmp, 0o644)
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        written += 1
    return written, current
