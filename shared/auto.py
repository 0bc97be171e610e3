"""``auto``: per request, the transfer method and setting with the lowest expected time to first
token among those whose validation quality is within a bound, read from the pair's operating table
(``<store>/<pair>.auto.json``, written by ``scd calibrate --method auto``).

The expected time of a point for a prompt of ``n`` transferred tokens over a link of ``r`` bit/s:

    n x (encode ms/token + reconstruct ms/token) + n x bytes/token x 8 / r

(the producer's prefill is common to every transfer method, so it does not change the choice; the
layers' pipelining is not modelled, so the estimate is an upper bound). The quality bound, by
default: validation KL no worse than raw transfer's, and no worse than half of raw's where some
point reaches that (the pair drifts enough for a correcting method to pay). ``max_kl_vs_raw``
sets the bound instead. The Oracle is not a candidate: it is the no-disaggregation baseline.

Differences finer than the table can resolve are ties: expected times within ``time_tolerance``
(default 5%: the table's per-token times repeat only to 5-10% from one calibration run to the next,
same machine, same prompts), and among those, validation KLs within ``kl_tolerance`` (default 10%)
of the lowest (24 validation prompts: a point's KL relative to raw's moved by 20% and more from
validation to the test split). Ties go to the fewest bytes on the wire: they are exact, and the link
is what a fleet's consumers share.

The link rate is a setting per consumer, else measured: the best goodput of the consumer's recent
transfers (wire bytes over the transfer time the consumer saw; a transfer slowed by encoding only
underestimates the link), else ``DEFAULT_LINK_MBPS`` until a transfer has been seen."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pydantic import Field, ValidationError

from shared.config import Checked, field_errors, first_field
from shared.errors import InvalidRequest, PreconditionFailed

DEFAULT_LINK_MBPS = 1000.0
DEFAULT_TIME_TOLERANCE = 0.05
DEFAULT_KL_TOLERANCE = 0.1
MIN_SAMPLE_BYTES = 256 << 10
"""Transfers smaller than this are latency-bound: they say little about the link's rate."""


LINK_MBPS = (0.001, 1e7)
"""The link rates ``auto`` plans for, Mbit/s: 1 kbit/s to 10 Tbit/s (1e-300 planned a transfer of 10^300 ms)."""


class AutoSettings(Checked):
    """What a request may set for ``auto`` (its method parameters)."""

    link_mbps: float | None = Field(None, ge=LINK_MBPS[0], le=LINK_MBPS[1])
    """The link rate to plan for, Mbit/s (default: the consumer's setting, else measured)."""
    max_kl_vs_raw: float | None = Field(None, gt=0)
    """Quality bound: validation KL at most this multiple of raw transfer's (default: 1, and 0.5
    where some point reaches it)."""
    time_tolerance: float = Field(DEFAULT_TIME_TOLERANCE, ge=0, le=1)
    """Expected times within this fraction of the fastest point's are a tie."""
    kl_tolerance: float = Field(DEFAULT_KL_TOLERANCE, ge=0)
    """Among tied times, validation KLs within this fraction of the lowest are a tie too; ties go to
    the fewest bytes."""

    @classmethod
    def parse(cls, params: dict[str, str] | None) -> "AutoSettings":
        try:
            return cls.model_validate(params or {})
        except ValidationError as e:
            raise InvalidRequest(f"invalid settings for method 'auto': {'; '.join(field_errors(e))} (its settings: "
                                 f"{', '.join(cls.model_fields)})", param=first_field(e)) from None


@dataclass(frozen=True)
class Choice:
    method: str
    params: dict[str, str]
    label: str
    expected_ms: float
    reason: str


def expected_ms(point: dict, n_tokens: int, link_mbps: float) -> float:
    per_token = point["encode_ms_per_token"] + point["reconstruct_ms_per_token"]
    return n_tokens * per_token + n_tokens * point["bytes_per_token"] * 8 / (link_mbps * 1e6) * 1e3


def choose(table: dict, n_tokens: int, link_mbps: float, link_source: str, settings: AutoSettings = AutoSettings(),
           usable: Callable[[dict], bool] | None = None, offered: Collection[str] | None = None) -> Choice:
    """The point of ``table`` (an ``AutoProfile``'s dict) to serve a prompt of ``n_tokens`` with.
    ``offered``: methods this server offers; ``usable``: whether a point can be served as measured
    (its method can be made and reads the artifacts it was measured with)."""
    raw = table["raw_kl"]
    points = [p for p in table["points"] if p["method"] != "oracle" and (offered is None or p["method"] in offered)
              and (usable is None or usable(p))]
    if not points:
        raise PreconditionFailed("auto: no point of the pair's operating table can be served here (methods not "
                                 "offered, or artifacts recalibrated since): rerun `scd calibrate --method auto`")
    if settings.max_kl_vs_raw is not None:
        bound, rule = settings.max_kl_vs_raw * raw, f"{settings.max_kl_vs_raw:g}x raw's KL (setting)"
    elif any(p["kl"] <= 0.5 * raw for p in points):
        bound, rule = 0.5 * raw, "0.5x raw's KL, which some point reaches"
    else:
        bound, rule = raw, "raw's KL"
    pool = [p for p in points if p["kl"] <= bound]
    if not pool:  # nothing within the bound: the most accurate point, and the reason says so
        pool, rule = [min(points, key=lambda p: p["kl"])], f"none within {rule}: the most accurate point"
    def ms_of(p: dict) -> float:
        return expected_ms(p, n_tokens, link_mbps)

    ranked = sorted(pool, key=ms_of)
    fastest = ranked[0]
    tied = [p for p in ranked if ms_of(p) <= ms_of(fastest) * (1 + settings.time_tolerance)]
    low = min(p["kl"] for p in tied)
    tied = [p for p in tied if p["kl"] <= low * (1 + settings.kl_tolerance)]
    best = min(tied, key=lambda p: (p["bytes_per_token"], ms_of(p)))
    ms = ms_of(best)
    rate = f"{link_mbps:{'.0f' if link_mbps >= 1 else '.3g'}}"
    stale = [p for p in table["points"] if p["method"] != "oracle" and (offered is None or p["method"] in offered)
             and usable is not None and not usable(p) and p["kl"] < best["kl"]]
    reason = (f"{best['label']}: expected {ms:.0f} ms for {n_tokens} tokens at {rate} Mbit/s "
              f"({link_source}); validation KL {best['kl']:.4f}, bound {bound:.4f} ({rule})")
    if best is not fastest:
        reason += (f"; a tie with the fastest ({fastest['label']} {ms_of(fastest):.0f} ms, KL {fastest['kl']:.4f}: "
                   f"within {settings.time_tolerance:.0%} in time, {settings.kl_tolerance:.0%} in KL), the fewest "
                   f"bytes ({best['bytes_per_token']:,.0f} vs {fastest['bytes_per_token']:,.0f}/token)")
    others = [p for p in ranked if p is not best]
    if others:
        reason += f"; next: {others[0]['label']} {ms_of(others[0]):.0f} ms"
    if stale:  # a fallback nobody would see otherwise: the table's better points no longer match the artifacts
        reason += (f"; fell back: {len(stale)} point(s) of lower validation KL cannot be served as measured "
                   f"({', '.join(p['label'] for p in stale)}: stale, the artifacts changed since the table was "
                   f"made; {remake_hint(table.get('pair', 'PAIR'))})")
    return Choice(best["method"], dict(best["params"]), best["label"], ms, reason)


def remake_hint(pair: str) -> str:
    return f"rerun `scd calibrate --pair {pair} --method auto`"


def why_not_servable(point: dict, ctx) -> str | None:
    """None when ``point`` can be served with the producer's codec context ``ctx`` as it was measured
    (its method can be made there and reads what it was measured with: the same
    ``TransferMethod.calibration``); else why not, in a few words."""
    from shared.codecs import make_method

    try:
        now = make_method(point["method"], ctx, point["params"]).calibration()
    except Exception as e:  # noqa: BLE001 - a point that cannot be made is not chosen
        return f"cannot be made here ({str(e)[:120]})"
    if now != point["pin"]:
        return f"stale (measured with calibration {point['pin'] or 'none'!r}, the store now holds {now or 'none'!r})"
    return None


def can_serve(point: dict, ctx) -> bool:
    """Whether ``point`` can be served with codec context ``ctx`` as it was measured."""
    return why_not_servable(point, ctx) is None


def stale_points(table: dict, ctx, offered: Collection[str] | None = None) -> dict[str, str]:
    """The points of an operating table (an ``AutoProfile``'s dict) that ``ctx`` cannot serve as they
    were measured, by label, with why (``why_not_servable``); ``offered``: only these methods'."""
    out = {}
    for p in table["points"]:
        if p["method"] == "oracle" or (offered is not None and p["method"] not in offered):
            continue
        why = why_not_servable(p, ctx)
        if why is not None:
            out[p["label"]] = why
    return out


class LinkEstimator:
    """Per consumer, the link rate ``auto`` plans for: the best goodput of the last ``window``
    transfers of at least ``MIN_SAMPLE_BYTES`` (thread-safe)."""

    def __init__(self, window: int = 16):
        self._rates: dict[str, deque[float]] = {}
        self._window = window
        self._lock = threading.Lock()

    def observe(self, consumer: str, wire_bytes: int, transfer_ms: float) -> None:
        if wire_bytes < MIN_SAMPLE_BYTES or transfer_ms <= 0:
            return
        with self._lock:
            self._rates.setdefault(consumer, deque(maxlen=self._window)).append(
                wire_bytes * 8 / (transfer_ms / 1e3) / 1e6)

    def estimate(self, consumer: str, setting: float | None = None) -> tuple[float, str]:
        """(Mbit/s, where it comes from)."""
        if setting is not None:
            return setting, "setting"
        with self._lock:
            seen = list(self._rates.get(consumer, ()))
        if not seen:
            return DEFAULT_LINK_MBPS, "default, nothing measured yet"
        return max(seen), f"best of {len(seen)} recent transfers"
