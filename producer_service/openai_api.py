"""The OpenAI request bodies the producer's HTTP front takes, how they are checked, and how one
becomes a ``GenerateRequest``. Each field the server uses takes its JSON type only; OpenAI features it
does not implement are refused when asked for, never answered without them."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from shared.config import field_errors, one_of
from shared.domain import GenerateRequest, SamplingRequest
from shared.errors import MAX_ID_CHARS, InvalidRequest, clip
from shared.rpc.http import usable_request_id

U32 = 2**32
TokenId = Annotated[int, Field(ge=0, lt=U32)]


class NotText(ValueError):
    """A string of the body that is not text; ``param`` is where it is (``messages.0.content``)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def check_text(value, where: tuple = ()) -> None:
    """Every string of the body must be encodable as UTF-8 (a lone surrogate such as "\\ud800"
    is valid JSON but not text)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            param = ".".join(map(str, where)) or None
            raise NotText(f"{param or 'the body'} holds a character that is not valid Unicode text at position "
                          f"{e.start} (a lone surrogate); send UTF-8 text", param) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, where)  # a key that is not text: said at its object
            check_text(v, (*where, k) if isinstance(k, str) and len(k) < 64 else where)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_text(v, (*where, i))


REQUIRED = ("model", "prompt", "messages")
"""Fields a null does not stand in for (every other null is the field's default)."""

UNSUPPORTED: dict[str, tuple] = {  # field -> its neutral values (booleans and numbers compare equal: False == 0)
    "echo": (False,), "logprobs": (False,), "top_logprobs": (0,), "best_of": (1,), "suffix": ("",),
    "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": (), "tools": (), "functions": (),
    "tool_choice": ("none", "auto"), "function_call": ("none", "auto"), "response_format": (),
    "audio": (), "modalities": (),
}
UNSUPPORTED_WHY = {
    "echo": "echo is not supported (the answer never repeats the prompt)",
    "logprobs": "logprobs are not supported by this server",
    "top_logprobs": "top_logprobs are not supported by this server",
    "best_of": "best_of other than 1 is not supported (one completion per request)",
    "suffix": "suffix (insertion) is not supported",
    "presence_penalty": "presence_penalty is not supported (sampling takes temperature, top_p, seed, stop)",
    "frequency_penalty": "frequency_penalty is not supported (sampling takes temperature, top_p, seed, stop)",
    "logit_bias": "logit_bias is not supported",
    "tools": "tools (function calling) are not supported",
    "functions": "functions (function calling) are not supported",
    "tool_choice": "tool_choice other than \"none\" or \"auto\" is not supported (no function calling)",
    "function_call": "function_call other than \"none\" or \"auto\" is not supported (no function calling)",
    "response_format": "response_format other than {\"type\": \"text\"} is not supported (no constrained output)",
    "audio": "audio output is not supported (this model writes text)",
    "modalities": "modalities other than [\"text\"] are not supported (this model writes text)",
}


def _no_nulls(data):
    """null is "not given" in OpenAI's API, in a nested object as in the body."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    """A last chunk with no choices and the request's ``usage`` (the other chunks' ``usage`` is null)."""

    _nulls = model_validator(mode="before")(_no_nulls)


class Body(BaseModel):
    # Fields that do not change the answer (user, metadata, ...) are ignored; the ones
    # the server uses take their JSON type only (strict: true is not a max_tokens of 1, nor "yes" a
    # stream flag, as the OpenAI API refuses them); UNSUPPORTED features are refused when asked for
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(..., min_length=1, max_length=256)
    """The consumer's name."""
    max_tokens: int | None = Field(None, ge=1, lt=U32)
    max_completion_tokens: int | None = Field(None, ge=1, lt=U32)
    temperature: float = Field(0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Above 0 (as vLLM and the wire take it: the wire's 0 means unset, i.e. 1); at most 1 is the consumer's check."""
    stop: Annotated[str | list[str], one_of("a string or a list of strings")] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    # OpenAI features this server does not implement: refused when asked for (a 400 naming the field),
    # never silently answered without them; their neutral values (null, false, 0, 1, "", [], {}) pass
    echo: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    best_of: Any = None
    suffix: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    # SCD extensions
    method: str = Field("", max_length=64)
    method_params: dict[str, Any] = {}
    """Method settings; values that are not strings (numbers, lists) are sent as JSON."""
    native_prefix: bool = True

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data):
        check_text(data)
        if isinstance(data, dict):  # null is "not given" in OpenAI's API (clients send temperature: null)
            data = {k: v for k, v in data.items() if v is not None or k in REQUIRED}
        return data

    @field_validator("method_params")
    @classmethod
    def _settings(cls, value: dict):
        """A setting given as null is not given (as everywhere in the body); a key is a setting's name."""
        if any(not k.strip() for k in value):
            raise ValueError("a key is a setting's name, e.g. {\"block_tokens\": 0.35}; got an empty one")
        return {k: v for k, v in value.items() if v is not None}

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_limit(cls, value, info: ValidationInfo):
        other = info.data.get("max_tokens")
        if value is not None and other is not None and other != value:
            raise ValueError(f"max_tokens ({other}) and max_completion_tokens ({value}) disagree; send one of them")
        return value

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        neutral = UNSUPPORTED[info.field_name or ""]
        if value is None or value in ([], {}) or value == {"type": "text"} and info.field_name == "response_format":
            return value
        if info.field_name == "modalities" and value == ["text"]:
            return value
        if isinstance(value, (str, int, float)) and value in neutral:  # bool is an int
            return value
        raise ValueError(f"{UNSUPPORTED_WHY[info.field_name or '']}; leave it out")


class CompletionBody(Body):
    prompt: Annotated[str | list[TokenId] | list[str] | list[list[TokenId]],
                      one_of(f"a string or a list of token ids (whole numbers 0 to {U32 - 1}), one prompt per request")]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _has_text(self):
        if self.type == "text" and self.text is None:
            raise ValueError('a text part holds its text: {"type": "text", "text": "..."}')
        return self


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Annotated[str | list[ContentPart], one_of(
        'a string or a list of content parts ({"type": "text", "text": "..."})')] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class ChatBody(Body):
    messages: list[Message] = Field(..., min_length=1)


def validation_message(errors) -> str:
    """One message for a body that does not validate: a body that is not a JSON object (or none)
    said as such, else each field's complaint."""
    bad_json = [e for e in errors if e.get("type") == "json_invalid"]
    if bad_json:  # loc: ("body", offset)
        at = bad_json[0].get("loc", ())[1:2]
        return (f"the body is not valid JSON{f' (at character {at[0]})' if at else ''}: "
                f"{bad_json[0].get('ctx', {}).get('error', bad_json[0]['msg'])}; send one JSON object")
    whole = [e for e in errors if len(e.get("loc", ())) <= 1]
    if whole:
        if whole[0].get("type") == "missing":
            return "the request has no body; send a JSON object (Content-Type: application/json)"
        if whole[0].get("type") == "value_error":  # the body's own check (check_text) said what is wrong
            return field_errors(whole[:1], skip=1)[0]
        return ("the body must be a JSON object with Content-Type: application/json, e.g. "
                '{"model": "NAME", "prompt": "..."}')
    msg = "; ".join(field_errors(errors, skip=1))  # every loc here has a field after "body"
    return f"invalid request: {msg[:2000]}"


def validation_param(errors) -> str | None:
    """The field the first complaint is about (``messages.0.role``), for the error body's ``param``;
    None for a body that is wrong as a whole."""
    first: dict = next((e for e in errors if e.get("type") != "json_invalid"), {})
    where = getattr(first.get("ctx", {}).get("error"), "param", None)  # check_text's, for the body as a whole
    return where or ".".join(str(p) for p in first.get("loc", ())[1:]) or None


def prompt_ids(fmt, body: CompletionBody, max_chars: int) -> list[int]:
    p = body.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, list) and p and not all(isinstance(x, int) for x in p):
        raise InvalidRequest("send one prompt per request (a string or a list of token ids)", param="prompt")
    if isinstance(p, list):
        return [int(x) for x in p]  # type: ignore[arg-type]  # checked above: all ints
    if fmt is None:
        raise InvalidRequest("this producer has no tokenizer; send the prompt as token ids", param="prompt")
    if not p.strip():
        raise InvalidRequest("prompt is empty; send a non-empty prompt", param="prompt")
    if len(p) > max_chars:
        raise InvalidRequest(f"prompt has {len(p)} characters; the limit is {max_chars}", param="prompt")
    return fmt.encode_text(p)[0]  # a completion prompt is plain text: the tokenizer's BOS, if any, then the text


def chat_ids(fmt, body: ChatBody, max_chars: int) -> list[int]:
    if fmt is None:
        raise InvalidRequest("this producer has no tokenizer; use /v1/completions with token ids", param="messages")
    for i, m in enumerate(body.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text":
                raise InvalidRequest(f"messages.{i}.content.{j} is a {part.type!r} part; this model reads text "
                                     "parts only", param=f"messages.{i}.content.{j}")
    msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    if not any(m["content"].strip() for m in msgs):
        raise InvalidRequest("messages carry no text; send at least one message with non-empty content",
                             param="messages")
    n = sum(len(m["content"]) for m in msgs)
    if n > max_chars:
        raise InvalidRequest(f"messages have {n} characters; the limit is {max_chars}", param="messages")
    return fmt.encode(msgs)[0]  # the consumer's chat template; its fixed prefix tokenized on its own


def openai_param(param: str | None, body: Body, chat: bool) -> str | None:
    """The body field an engine error names (``param``, in the wire's words: ``prompt``,
    ``max_new_tokens``, ``consumer``) as this body calls it."""
    if param == "prompt" and chat:
        return "messages"
    if param == "max_new_tokens":
        return "max_completion_tokens" if body.max_tokens is None and body.max_completion_tokens else "max_tokens"
    return "model" if param == "consumer" else param


def client_request_id(header: str | None) -> str:
    """The request's id: the client's ``X-Request-Id`` (``shared.rpc.http.usable_request_id``), else a
    new one."""
    if header is None:
        return uuid.uuid4().hex
    if not usable_request_id(header):
        try:  # HTTP hands headers over as latin-1: say what the client sent (UTF-8 "é", not "Ã©")
            said = header.encode("latin-1").decode("utf-8")
        except UnicodeError:
            said = header
        raise InvalidRequest(f"X-Request-Id must be 1-{MAX_ID_CHARS} printable ASCII characters; got {clip(said)}")
    return header


def to_request(body: Body, ids: list[int], request_id: str = "") -> GenerateRequest:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return GenerateRequest(
        prompt=tuple(ids), consumer=body.model, method=body.method,
        method_params={k: v if isinstance(v, str) else json.dumps(v) for k, v in body.method_params.items()},
        native_prefix=body.native_prefix, request_id=request_id,  # empty: the servicer makes one
        sampling=SamplingRequest(max_new_tokens=body.max_completion_tokens or body.max_tokens or 0,
                                 temperature=body.temperature, top_p=body.top_p, stop=tuple(stop), seed=body.seed),
    )
