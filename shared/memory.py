"""Memory a request freed goes back to the system. The services' tensors come and go with each
request (a consumer holds a stream's decoded layers and its cache, a producer its prefill states);
glibc's allocator keeps much of what they free in its arenas (a tiny consumer held 55-65 MB more
after 360 streams, all of it returned by a trim). ``release_freed`` asks the allocator to return it
(``malloc_trim``), at most once per ``MIN_INTERVAL_S``; it costs well under 10 ms. Elsewhere than
glibc it does nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

MIN_INTERVAL_S = 1.0

_lock = threading.Lock()
_last = 0.0


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
        return None


_TRIM = _malloc_trim()


def release_freed(force: bool = False) -> bool:
    """Return the allocator's free memory to the system (rate-limited unless ``force``); whether it ran."""
    global _last
    if _TRIM is None:
        return False
    now = time.monotonic()
    with _lock:
        if not force and now - _last < MIN_INTERVAL_S:
            return False
        _last = now
    _TRIM(0)
    return True
