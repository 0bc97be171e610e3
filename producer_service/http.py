"""OpenAI-compatible HTTP front of the producer: ``POST /v1/completions``, ``POST
/v1/chat/completions`` (``stream: true`` as server-sent events), ``GET /v1/models`` (each consumer
is a model), ``/health`` and ``/metrics``.

A thin layer: each request becomes a ``GenerateRequest`` run through the same code path as the gRPC
``Generate`` (``ProducerServicer.generate``). A client that disconnects closes that generator, which
cancels the consumer's call and frees the request on both sides."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import grpc
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.middleware.cors import CORSMiddleware

from producer_service.openai_api import (
    Body,
    ChatBody,
    CompletionBody,
    chat_ids,
    client_request_id,
    openai_param,
    prompt_ids,
    to_request,
    validation_message,
    validation_param,
)
from producer_service.servicer import ProducerServicer
from shared.config import consumer_list
from shared.domain import TokenEvent
from shared.errors import InvalidRequest, SCDError, clip
from shared.rpc.errors import status_for
from shared.rpc.http import (
    READ_METHODS,
    HTTPAccounting,
    add_auth,
    add_metrics_routes,
    add_route_errors,
    error_body,
    error_response,
)


def _scd_timings(ev: TokenEvent) -> dict:
    """The ``scd_timings`` of a response: what the final event says the request cost."""
    t = ev.timings
    assert t is not None  # called on the final event only
    out = {"method": t.method, "ttft_ms": t.ttft_ms, "wire_bytes": t.wire_bytes,
           "fallback_recompute": t.fallback_recompute}
    if t.auto_reason:
        out["auto_reason"] = t.auto_reason
    return out


def _choice(index: int, text: str, finish: str | None, chat: bool) -> dict:
    """One choice of a streamed chunk (chat: a ``delta``) or of a completion."""
    body: dict[str, Any] = {"delta": {"content": text}} if chat else {"text": text}
    return {"index": index, **body, "finish_reason": finish or None, "logprobs": None}


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is refused with 413, by its
    Content-Length before it is read, or as it arrives when it is chunked (never read whole); a
    compressed one (Content-Encoding) with 415; one that has not all arrived ``timeout`` seconds
    after the headers with 408 (a client that stops sending mid-body held its connection for ever)."""

    def __init__(self, app, limit: int, timeout: float = 30.0):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        msg = f"request body over {self.limit} bytes (max_http_body_bytes); send a smaller request"
        headers = dict(scope.get("headers") or ())
        coding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
        if coding not in ("", "identity"):  # a compressed body would be read as broken JSON
            return await _send_error(send, 415, f"Content-Encoding {clip(coding)} is not supported: send the body "
                                                "uncompressed (leave the header out)")
        n = headers.get(b"content-length")
        if n is not None and (not n.isdigit() or int(n) > self.limit):
            return await _send_error(send, 413, msg)
        seen, read, started = 0, False, False
        refused: tuple[int, str] | None = None
        deadline = asyncio.get_running_loop().time() + self.timeout

        async def limited():
            nonlocal seen, read, refused
            if read:  # the body is in: what comes next (a disconnect) may take as long as the answer
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                refused = (408, f"the request body did not arrive within {self.timeout:g} s "
                                "(http.read_timeout_s); send the whole body at once")
                raise HTTPException(408, refused[1]) from None  # stops the read; the answer is replaced
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                read = not message.get("more_body", False)
                if seen > self.limit:
                    refused = (413, msg)
                    raise HTTPException(413, msg)
            return message

        async def guarded(message):
            nonlocal started
            if refused is not None:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, guarded)
        except Exception:
            if refused is None:
                raise
        if refused is not None and not started:
            await _send_error(send, *refused)


async def _send_error(send, status: int, message: str) -> None:
    code = grpc.StatusCode.DEADLINE_EXCEEDED if status == 408 else grpc.StatusCode.INVALID_ARGUMENT
    body = json.dumps(error_body(code, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 408:  # the rest of that body may still come: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
"""The paths ``http_responses`` names (any other, /v1/models/NAME included, is "other")."""

CLIENT_CLOSED = 499  # nginx's "client closed request": what the access log shows for an answer nobody read


async def _hung_up(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next ASGI message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Cors(CORSMiddleware):
    """Starlette's CORS; a preflight it refuses is answered as every refusal here is, an OpenAI-style
    error that says what to change, with the CORS headers a browser reads it by."""

    def preflight_response(self, request_headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code < 400:
            return answer
        origin, method = request_headers["origin"], request_headers["access-control-request-method"]
        said = []
        if not self.is_allowed_origin(origin=origin):
            said.append(f"origin {clip(origin)} may not call this API from a browser; add it to the producer's "
                        f"http.cors_origins (now {sorted(self.allow_origins)})")
        if method not in self.allow_methods:
            said.append(f"method {clip(method)} is not served here ({', '.join(self.allow_methods)})")
        if not said:  # what else Starlette refuses: a private-network preflight
            said.append("a private-network preflight is refused (a public page may not reach this server)")
        refused = error_response(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(said))
        for name, value in answer.headers.items():
            if name.startswith("access-control-") or name == "vary":
                refused.headers[name] = value
        return refused


def make_app(servicer: ProducerServicer, token: str | None = None) -> FastAPI:
    eng = servicer.engine
    s = eng.settings
    # no 307 to the path without a trailing '/' (FastAPI's default): the openai client and curl do not
    # follow it for a POST, and showed an empty answer; the 404 says where to send the request
    app = FastAPI(title="scd producer", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    add_metrics_routes(app, servicer.metrics, servicer.ready, lambda: {"consumers": dict(servicer.consumer_status)})
    add_auth(app, token, servicer.metrics)
    app.add_middleware(BodyLimit, limit=s.max_http_body_bytes, timeout=s.http.read_timeout_s)  # before the token check
    if s.http.cors_origins:  # outside the token check: a browser's preflight carries no token
        app.add_middleware(Cors, allow_origins=list(s.http.cors_origins), allow_methods=list(READ_METHODS) +
                           ["POST"], allow_headers=["*"], expose_headers=["X-Request-Id", "Retry-After"])
    app.add_middleware(HTTPAccounting, metrics=servicer.metrics, paths=PATHS, access_log=s.access_log)  # outermost

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return error_response(grpc.StatusCode.INVALID_ARGUMENT, validation_message(exc.errors()),
                              validation_param(exc.errors()))

    add_route_errors(app, "POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/NAME], GET /health, "
                          "GET /metrics",
                     preflight="to let a web page call this API, list its origin in the producer's http.cors_origins")

    def _model(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "scd"}

    @app.api_route("/v1/models", methods=READ_METHODS)
    async def models():
        return {"object": "list", "data": [_model(n) for n in s.consumers]}

    @app.api_route("/v1/models/{name}", methods=READ_METHODS)
    async def model(name: str):
        if name not in s.consumers:
            return error_response(grpc.StatusCode.NOT_FOUND,
                                  f"unknown model {clip(name)}; this producer serves {sorted(s.consumers)}")
        return _model(name)

    def status(e: BaseException, body: Body, chat: bool) -> tuple:
        """(code, message, param) of an error, its param named as the body calls it (in the message too:
        the consumer's limit on ``max_new_tokens`` is this body's ``max_tokens``)."""
        code, msg = status_for(e)
        wire = getattr(e, "param", None)
        param = openai_param(wire, body, chat)
        if wire == "max_new_tokens" and param:
            msg = msg.replace("max_new_tokens=", f"{param}=")
        return code, msg, param

    async def run(body: Body, ids: list[int], chat: bool, request_id: str):
        req = to_request(body, ids, request_id)
        rid = ("chatcmpl-" if chat else "cmpl-") + req.request_id
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        events = servicer.generate(req, None)
        try:  # the first event comes before any response: errors up to it get their own HTTP status
            first = await anext(events)
        except StopAsyncIteration:
            first = None
        except Exception as e:  # noqa: BLE001 - mapped like the gRPC side
            await events.aclose()
            return error_response(*status(e, body, chat))

        def usage(ev: TokenEvent | None) -> dict | None:
            if ev is None or ev.timings is None:
                return None
            t = ev.timings
            return {"prompt_tokens": t.prompt_tokens, "completion_tokens": t.completion_tokens,
                    "total_tokens": t.prompt_tokens + t.completion_tokens}

        def timings(ev: TokenEvent) -> dict:
            return _scd_timings(ev)

        def choice(text: str, finish: str | None) -> dict:
            return _choice(0, text, finish, chat)

        if not body.stream:
            text, last = "", first
            async with contextlib.aclosing(events):
                if first is not None:
                    text = first.text
                    try:
                        async for ev in events:
                            text += ev.text
                            last = ev
                    except Exception as e:  # noqa: BLE001
                        return error_response(*status(e, body, chat))
            finish = last.finish_reason if last is not None else "stop"
            c = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                  "logprobs": None} if chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
            out = {"id": rid, "object": obj, "created": created, "model": body.model, "choices": [c],
                   "usage": usage(last)}
            if last is not None and last.timings is not None:
                out["scd_timings"] = timings(last)
            return JSONResponse(out)

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def sse(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        async def stream():
            async with contextlib.aclosing(events):
                if chat:
                    yield sse({"id": rid, "object": chunk_obj, "created": created, "model": body.model,
                               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None, "logprobs": None}],
                               **({"usage": None} if body.include_usage else {})})
                ev, used = first, None
                try:
                    while ev is not None:
                        data = {"id": rid, "object": chunk_obj, "created": created, "model": body.model,
                                "choices": [choice(ev.text, ev.finish_reason)]}
                        if ev.timings is not None:
                            used = usage(ev)
                            data["scd_timings"] = timings(ev)
                        # the usage: on the last chunk, or (stream_options.include_usage, as OpenAI's) null
                        # there and on a chunk of its own with no choices
                        if body.include_usage or used is not None:
                            data["usage"] = None if body.include_usage else used
                        yield sse(data)
                        ev = await anext(events, None)
                    if body.include_usage:
                        yield sse({"id": rid, "object": chunk_obj, "created": created, "model": body.model,
                                   "choices": [], "usage": used})
                except Exception as e:  # noqa: BLE001 - after the first event only a final error event can say it
                    yield sse(error_body(*status(e, body, chat)))
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def fan_out(body: Body, names: list[str], ids: list[list[int]], chat: bool, request_id: str):
        """One prompt to several consumers (``model: "a,b"``): the requests run concurrently and the
        producer shares one base prefill between them. Choice ``i`` is consumer ``names[i]`` (its
        name in the choice's ``model``); a consumer that fails gets ``finish_reason: "error"`` and
        an OpenAI-style ``error`` in its choice, the others still answer."""
        rid = ("chatcmpl-" if chat else "cmpl-") + request_id
        created = int(time.time())
        queue: asyncio.Queue = asyncio.Queue()

        async def one(i: int, name: str):
            req = to_request(body.model_copy(update={"model": name}), ids[i], request_id)  # one id, per consumer
            try:
                async with contextlib.aclosing(servicer.generate(req, None)) as events:
                    async for ev in events:
                        await queue.put((i, ev, None))
            except Exception as e:  # noqa: BLE001 - mapped like the gRPC side, per consumer
                await queue.put((i, None, status(e, body, chat)))
            await queue.put((i, None, "done"))

        def piece(i: int, text: str, finish: str | None, err: tuple | None = None) -> dict:
            c = {**_choice(i, text, finish, chat), "model": names[i]}
            if err is not None:
                c["error"] = error_body(*err)["error"]
            return c

        async def events():
            tasks = [asyncio.create_task(one(i, n)) for i, n in enumerate(names)]
            try:
                left = len(names)
                while left:
                    i, ev, err = await queue.get()
                    if err == "done":
                        left -= 1
                    else:
                        yield i, ev, err
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        def timings(ev: TokenEvent) -> dict:  # each choice has its own tokens and prefill
            t = ev.timings
            assert t is not None
            return {**_scd_timings(ev), "prefill_ms": t.prefill_ms, "prompt_tokens": t.prompt_tokens,
                    "completion_tokens": t.completion_tokens}

        def summed(tims: list[dict | None]) -> dict:  # usage: summed over the consumers that answered
            done = [t for t in tims if t is not None]
            prompt, completion = sum(t["prompt_tokens"] for t in done), sum(t["completion_tokens"] for t in done)
            return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

        obj = "chat.completion" if chat else "text_completion"
        if not body.stream:
            texts, finish = [""] * len(names), ["stop"] * len(names)
            errs: list[tuple | None] = [None] * len(names)
            tims: list[dict | None] = [None] * len(names)
            async with contextlib.aclosing(events()) as evs:
                async for i, ev, err in evs:
                    if err is not None:
                        errs[i], finish[i] = err, "error"
                        continue
                    texts[i] += ev.text
                    finish[i] = ev.finish_reason or finish[i]
                    if ev.timings is not None:
                        tims[i] = timings(ev)
            if all(e is not None for e in errs):  # nobody answered: the first consumer's error, as one request's
                e0 = errs[0]
                assert e0 is not None
                return error_response(*e0)
            choices = []
            for i in range(len(names)):
                c = piece(i, texts[i], finish[i], errs[i])
                if chat:
                    c["message"] = {"role": "assistant", "content": c.pop("delta")["content"]}
                c["scd_timings"] = tims[i]
                choices.append(c)
            return JSONResponse({"id": rid, "object": obj, "created": created, "model": body.model,
                                 "choices": choices, "usage": summed(tims)})

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def stream():
            head = {"id": rid, "object": chunk_obj, "created": created, "model": body.model}
            usage_null = {"usage": None} if body.include_usage else {}  # as OpenAI's: the usage on a chunk of its own
            async with contextlib.aclosing(events()) as evs:
                if chat:
                    for i in range(len(names)):
                        c = piece(i, "", None)
                        c["delta"]["role"] = "assistant"
                        yield f"data: {json.dumps({**head, 'choices': [c], **usage_null})}\n\n"
                tims: list[dict | None] = [None] * len(names)
                ended = 0
                async for i, ev, err in evs:
                    c = piece(i, "", "error", err) if err is not None else piece(i, ev.text, ev.finish_reason)
                    if ev is not None and ev.timings is not None:
                        c["scd_timings"] = tims[i] = timings(ev)
                    ended += err is not None or bool(ev is not None and ev.finish_reason)
                    # the usage as one consumer's stream has it: on the last chunk, unless include_usage
                    # puts it on a chunk of its own
                    last = {"usage": summed(tims)} if not body.include_usage and ended == len(names) else {}
                    yield f"data: {json.dumps({**head, 'choices': [c], **usage_null, **last})}\n\n"
                if body.include_usage:
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': summed(tims)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def handle(body, encode, chat: bool, request_id: str, state):
        """The prompt encoded with the consumer's format (errors as OpenAI-style 4xx), then the run;
        ``model: "a,b"`` fans it out to several consumers. ``state.engine``: the request reached the
        engine, whose request log has it (``HTTPAccounting`` logs the others)."""
        try:
            if "," in body.model:
                try:
                    names = consumer_list(body.model)
                except ValueError as e:
                    raise InvalidRequest(f"model {body.model!r}: {e}", param="model") from None
                eng.check_consumers(*names, param="model")
                each = [encode(eng.prompt_format(n), body, s.max_prompt_chars) for n in names]
                state.engine = True
                return await fan_out(body, names, each, chat, request_id)
            ids = encode(eng.prompt_format(body.model), body, s.max_prompt_chars)
        except SCDError as e:
            return error_response(*status(e, body, chat))
        state.engine = True
        return await run(body, ids, chat, request_id)

    async def answer(request: Request, body, encode, chat: bool) -> Response:
        """``handle``, called off when the client hangs up before the response begins: a
        non-streamed answer (or a stream still before its first token) would otherwise be
        generated to its end for nobody, holding the consumer's slot. Once a stream has begun,
        its response notices the hang-up itself. The response carries the request's id
        (``X-Request-Id``: the client's own, else a new one)."""
        try:
            rid = client_request_id(request.headers.get("x-request-id"))
        except InvalidRequest as e:
            return error_response(*status_for(e))
        work = asyncio.ensure_future(handle(body, encode, chat, rid, request.state))
        gone = asyncio.ensure_future(_hung_up(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return Response(status_code=CLIENT_CLOSED)  # nobody is there to read it
        response = work.result()
        response.headers["x-request-id"] = rid
        return response

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        return await answer(request, body, prompt_ids, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatBody):
        return await answer(request, body, chat_ids, True)

    return app
