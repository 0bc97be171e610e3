from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_LZ4: _ClassVar[Compression]
    COMPRESSION_ZSTD: _ClassVar[Compression]
    COMPRESSION_NONE: _ClassVar[Compression]
COMPRESSION_LZ4: Compression
COMPRESSION_ZSTD: Compression
COMPRESSION_NONE: Compression

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "stop", "seed")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "consumer", "method", "method_params", "sampling", "native_prefix", "request_id")
    class MethodParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    METHOD_PARAMS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NATIVE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    consumer: str
    method: str
    method_params: _containers.ScalarMap[str, str]
    sampling: SamplingParams
    native_prefix: bool
    request_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., consumer: _Optional[str] = ..., method: _Optional[str] = ..., method_params: _Optional[_Mapping[str, str]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., native_prefix: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("ttft_ms", "prefill_ms", "encode_ms", "wire_bytes", "payload_bytes", "reconstruct_ms", "transfer_ms", "last_frame_to_first_token_ms", "decode_tokens_per_s", "prompt_tokens", "completion_tokens", "method", "fallback_recompute", "auto_reason", "method_identity", "consumer_fingerprint")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECONSTRUCT_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_FRAME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    AUTO_REASON_FIELD_NUMBER: _ClassVar[int]
    METHOD_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    prefill_ms: float
    encode_ms: float
    wire_bytes: int
    payload_bytes: int
    reconstruct_ms: float
    transfer_ms: float
    last_frame_to_first_token_ms: float
    decode_tokens_per_s: float
    prompt_tokens: int
    completion_tokens: int
    method: str
    fallback_recompute: bool
    auto_reason: str
    method_identity: str
    consumer_fingerprint: str
    def __init__(self, ttft_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., encode_ms: _Optional[float] = ..., wire_bytes: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., reconstruct_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., last_frame_to_first_token_ms: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., method: _Optional[str] = ..., fallback_recompute: _Optional[bool] = ..., auto_reason: _Optional[str] = ..., method_identity: _Optional[str] = ..., consumer_fingerprint: _Optional[str] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("text", "token_id", "index", "finish_reason", "timings", "request_id", "error")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_id: int
    index: int
    finish_reason: str
    timings: Timings
    request_id: str
    error: ErrorStatus
    def __init__(self, text: _Optional[str] = ..., token_id: _Optional[int] = ..., index: _Optional[int] = ..., finish_reason: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., request_id: _Optional[str] = ..., error: _Optional[_Union[ErrorStatus, _Mapping]] = ...) -> None: ...

class ErrorStatus(_message.Message):
    __slots__ = ("code", "message", "param")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    param: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., param: _Optional[str] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("request_id", "method", "method_version", "protocol_version", "pair_fingerprint", "n_layers", "n_tokens", "prompt_ids", "params", "sampling", "native_prefix", "prefix_len", "consumer", "deadline_unix")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    METHOD_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAIR_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NATIVE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    method: str
    method_version: int
    protocol_version: int
    pair_fingerprint: str
    n_layers: int
    n_tokens: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _containers.ScalarMap[str, str]
    sampling: SamplingParams
    native_prefix: bool
    prefix_len: int
    consumer: str
    deadline_unix: float
    def __init__(self, request_id: _Optional[str] = ..., method: _Optional[str] = ..., method_version: _Optional[int] = ..., protocol_version: _Optional[int] = ..., pair_fingerprint: _Optional[str] = ..., n_layers: _Optional[int] = ..., n_tokens: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Mapping[str, str]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., native_prefix: _Optional[bool] = ..., prefix_len: _Optional[int] = ..., consumer: _Optional[str] = ..., deadline_unix: _Optional[float] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("name", "layer", "dtype", "shape", "offset", "raw_size", "data", "crc32c", "last", "layer_done", "compression")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    RAW_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    LAYER_DONE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    layer: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    raw_size: int
    data: bytes
    crc32c: int
    last: bool
    layer_done: bool
    compression: Compression
    def __init__(self, name: _Optional[str] = ..., layer: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., raw_size: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., last: _Optional[bool] = ..., layer_done: _Optional[bool] = ..., compression: _Optional[_Union[Compression, str]] = ...) -> None: ...

class Trailer(_message.Message):
    __slots__ = ("n_chunks", "payload_bytes", "raw_bytes", "crc32c", "encode_ms", "prefill_ms")
    N_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    n_chunks: int
    payload_bytes: int
    raw_bytes: int
    crc32c: int
    encode_ms: float
    prefill_ms: float
    def __init__(self, n_chunks: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., crc32c: _Optional[int] = ..., encode_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ...) -> None: ...

class KVFrame(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: Header
    chunk: TensorChunk
    trailer: Trailer
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConsumerInfo(_message.Message):
    __slots__ = ("name", "model_fingerprint", "methods", "n_layers", "protocol_version", "producer_fingerprint")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    METHODS_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_fingerprint: str
    methods: _containers.RepeatedScalarFieldContainer[str]
    n_layers: int
    protocol_version: int
    producer_fingerprint: str
    def __init__(self, name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., methods: _Optional[_Iterable[str]] = ..., n_layers: _Optional[int] = ..., protocol_version: _Optional[int] = ..., producer_fingerprint: _Optional[str] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("layers", "wire_bytes")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    layers: int
    wire_bytes: int
    def __init__(self, layers: _Optional[int] = ..., wire_bytes: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupEntry(_message.Message):
    __slots__ = ("key", "n_tokens", "state", "error")
    KEY_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    key: str
    n_tokens: int
    state: str
    error: str
    def __init__(self, key: _Optional[str] = ..., n_tokens: _Optional[int] = ..., state: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[LookupEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[LookupEntry, _Mapping]]] = ...) -> None: ...
