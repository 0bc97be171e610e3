"""Domain exceptions. Each carries what the caller must fix; ``shared/rpc/errors.py`` maps them
to gRPC status codes (and the HTTP front to HTTP codes)."""


MAX_ID_CHARS = 128
"""Request ids and names a peer sends are at most this long (they are echoed in every token event)."""


def usable_request_id(rid: str) -> bool:
    """Whether a client's request id (HTTP's ``X-Request-Id``, gRPC's ``request_id``) can be the
    request's id: 1-128 printable ASCII characters (it is sent back, shown in both services'
    request logs, in the response's ``id`` and in an HTTP header, which carries ASCII only)."""
    return 0 < len(rid) <= MAX_ID_CHARS and rid.isascii() and rid.isprintable()


def clip(text: str, n: int = 64) -> str:
    """A string from a request, quoted in an error message: bounded, so that an error never grows
    with its input."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text)} characters)"


class SCDError(Exception):
    """Base of every domain error. ``param``: the request field at fault, where one is (the HTTP
    front's OpenAI-style error body names it)."""

    def __init__(self, *args, param: str | None = None):
        super().__init__(*args)
        self.param = param


class InvalidRequest(SCDError, ValueError):
    """The request itself is malformed (empty prompt, bad sampling values...)."""


class NotFound(SCDError, LookupError):
    """A named thing (consumer, method, artifact) does not exist."""


class UnknownMethod(NotFound):
    """A transfer method that is not registered (or not enabled on this service)."""


class PreconditionFailed(SCDError):
    """Both sides are fine on their own but do not match (fingerprint, protocol or method version)."""


class FingerprintMismatch(PreconditionFailed):
    """The stream was produced by other weights or settings than the consumer was calibrated for."""


class DataLoss(SCDError):
    """A frame's bytes are corrupt (checksum mismatch, undecodable payload)."""


class InvalidPayload(SCDError, ValueError):
    """A frame stream is well formed bytes but violates the protocol (order, shape, dtype, size)."""


class ResourceExhausted(SCDError):
    """Admission control: the service is at capacity."""


class NotReady(SCDError):
    """The service (or its peer) is not ready to serve."""


class ConfigError(SCDError, ValueError):
    """Settings that cannot work (raised at start-up, never per request)."""


class PeerError(SCDError):
    """The other service answered with an error status; relayed with its code and message."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message, param=param)
        self.code = code
