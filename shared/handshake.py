"""What a receiver of a cache stream checks of its header before it keeps a byte, and what it tells
the operator when the two sides do not match: one set of checks for the consumer service and the
vLLM connector's receiver (``integrations/vllm_connector``)."""

from __future__ import annotations

from shared.codecs import CODECS
from shared.domain import StreamHeader
from shared.rpc.wire import PROTOCOL_VERSION


def incompatibility(h: StreamHeader, n_layers: int, producer_fingerprint: str | None,
                    receiver: str = "this consumer") -> tuple[str, str] | None:
    """(reason, actionable message) when the stream was made by another protocol or method version,
    other producer weights (when ``producer_fingerprint`` is known) or another depth; else None.
    ``h.method`` must be a registered method (checked before)."""
    if h.protocol_version != PROTOCOL_VERSION:
        side = "producer" if h.protocol_version < PROTOCOL_VERSION else "consumer"
        return "protocol", (f"protocol version {h.protocol_version} from the producer; {receiver} speaks "
                            f"{PROTOCOL_VERSION}: update the {side}")
    cls = CODECS[h.method]
    if h.method_version != cls.version:
        side = "producer" if h.method_version < cls.version else "consumer"
        return "method_version", (f"method {h.method!r} version {h.method_version} from the producer; {receiver} "
                                  f"has version {cls.version}: update the {side}")
    if producer_fingerprint and h.producer_fingerprint != producer_fingerprint:
        return "fingerprint", (
            f"stream made by producer weights {h.producer_fingerprint!r}; {receiver} accepts "
            f"{producer_fingerprint!r}: point the producer at the right model or recalibrate the pair "
            "and update the consumer's artifacts")
    if h.n_layers != n_layers:
        return "layers", (f"stream has {h.n_layers} layers; the consumer model has {n_layers}: the producer is "
                          "serving another model family; fix the producer's consumers setting")
    return None


def pin_mismatch(h: StreamHeader, local_pin: str, receiver: str = "this consumer") -> str | None:
    """The message when the producer encoded with other calibration artifacts (or profile) than the
    receiver loaded for the method; else None."""
    if h.pin == local_pin:
        return None
    return (f"the producer encoded with calibration data {h.pin or 'none'!r} for method {h.method!r}; {receiver} "
            f"loaded {local_pin or 'none'!r}: deploy the same `scd calibrate` output (artifact store) to both sides")
