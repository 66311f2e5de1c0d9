"""An OpenAI-compatible API over the loaded engine: `POST /v1/chat/completions`, `GET /v1/models`.

So editors and agents that speak the OpenAI protocol can use whichever backend flashcode runs
(MLX, llama-server, flash streaming): requests go through the shared engine `Worker`, in turn with
the web app's own replies, so MLX stays on the engine thread.

Who may call: clients on the loopback interface, or any client carrying the server's access token
(`webapp.security`; required when flashcode is bound beyond loopback, and then enough on its own);
when `$FLASHCODE_API_TOKEN` is set, `Authorization: Bearer TOKEN` is required. A request with an
`Origin` header must come from one of the app's own origins (checked by
`webapp.security.CsrfMiddleware` before it arrives: a web page elsewhere cannot drive the model
through the user's browser).

What is covered: chat messages (text parts only), temperature, top_p, max_tokens /
max_completion_tokens, seed, stop, stream with `stream_options.include_usage`, usage with cached
prompt tokens. What is not: tools / function calling, images, logprobs, n > 1 — each is refused with
an OpenAI-shaped 400 rather than ignored.

Models load on demand (as LM Studio and Ollama do; docs/openai-api.md): `GET /v1/models` lists every
installed model, and a request naming one that is not loaded loads it — in RAM if it fits with room to
spare, else flash (`engine.placement`), or on the engine named as `backend:model` — through the app's one
`EngineState`, so the chat's model menu follows. One model is loaded at a time: the switch and the
queuing of the request's generation happen under the engine's lock, so concurrent requests for two
models take turns and each is answered by the model it named.

What it is given (by `create_app`): the app's `EngineState`, and `record(stats)`, called with each
finished reply's numbers (the stats feature stores them with source "api").
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.base import (
    Done,
    EngineError,
    GenerationRequest,
    Message,
    ModelNotFoundError,
    SamplingParams,
    TextDelta,
)
from engine.models import installed_by_start, list_models
from engine.registry import available_backends
from engine.stops import MAX_STOP_CHARS
from engine.worker import Generation, Worker

from ..engine_host import EngineState
from ..security import authenticated

log = logging.getLogger(__name__)
_background: set[asyncio.Task[None]] = set()  # recordings of replies cut by their client, kept referenced

TOKEN_ENV = "FLASHCODE_API_TOKEN"
LOOPBACK_CLIENTS = {"127.0.0.1", "::1", "localhost"}
MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_TOKENS = 1024
ROLE_MAP = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "user",
}
ANY_MODEL = {"", "default", "flashcode"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


ReplyRecorder = Callable[[Mapping[str, Any]], object]


# --------------------------------------------------------------------------- access
def api_token() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def check_access(request: Request) -> None:
    client = request.client.host if request.client else ""
    token_ok = authenticated(request.scope)  # carried the server's token (webapp.security): any client
    if client not in LOOPBACK_CLIENTS and not token_ok:
        raise APIError(
            403,
            f"the flashcode API answers loopback clients only, not {client}",
            "permission_error",
            "forbidden",
        )
    token = api_token()
    if token and not token_ok:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), token.encode()):
            raise APIError(
                401,
                f"missing or wrong API key: send Authorization: Bearer <the token in ${TOKEN_ENV}>",
                "authentication_error",
                "invalid_api_key",
            )


def loaded(worker: Worker) -> tuple[str, str] | None:
    b = worker.backend
    return (b.name, b.model.name) if b is not None and b.model is not None else None


# --------------------------------------------------------------------------- parsing
def parse_messages(raw: Any) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    out: list[Message] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLE_MAP:
            raise APIError(
                400, f"messages[{i}].role must be one of {', '.join(ROLE_MAP)}", param=f"messages[{i}]"
            )
        content = _text(m.get("content"), i)
        if m["role"] == "tool":
            content = f"Tool result:\n{content}"
        out.append({"role": ROLE_MAP[m["role"]], "content": content})
    return tuple(out)


def _text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(
                    400,
                    f"messages[{i}]: only text content is supported, not {kind}",
                    param=f"messages[{i}].content",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise APIError(
        400, f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content"
    )


MAX_TOKENS_LIMIT = 2**31 - 1  # any more is not a request for tokens (the context caps it long before)


def _number(body: Mapping[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    """`body[key]` as OpenAI takes it: a JSON number from `lo` to `hi` (null or absent: `default`)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise APIError(400, f"{key} must be a number from {lo:g} to {hi:g}", param=key)
    return float(value)


def _integer(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise APIError(400, f"{key} must be an integer from {lo} to {hi}", param=key)
    return value


def parse_sampling(body: dict[str, Any]) -> SamplingParams:
    """The request's sampling fields, each checked as OpenAI checks it: a value of the wrong type or out of
    range is a 400 naming its field (never a 500, never a silent default)."""
    for unsupported in ("tools", "functions"):
        if body.get(unsupported):
            raise APIError(
                400,
                f"{unsupported} are not supported by flashcode's API: send plain chat messages",
                param=unsupported,
            )
    if isinstance(body.get("n"), bool) or body.get("n") not in (
        None,
        1,
    ):  # `true == 1` in Python, not in JSON
        raise APIError(400, "n must be 1", param="n")
    if body.get("logprobs"):
        raise APIError(400, "logprobs are not supported", param="logprobs")
    if body.get("top_logprobs"):
        raise APIError(400, "top_logprobs are not supported", param="top_logprobs")
    if body.get("logit_bias"):  # accepted and ignored, it would change nothing the client asked for
        raise APIError(400, "logit_bias is not supported by flashcode's API", param="logit_bias")
    if body.get("tool_choice") not in (None, "none", "auto"):  # "required" or a function: there are no tools
        raise APIError(
            400, "tool_choice needs tools, which flashcode's API does not support", param="tool_choice"
        )
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise APIError(
            400,
            'response_format other than {"type": "text"} is not supported by flashcode\'s API '
            "(no JSON mode or schema): ask for JSON in the messages",
            param="response_format",
        )
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, -2.0, 2.0, 0.0) != 0.0:
            raise APIError(400, f"{key} is not supported by flashcode's API: leave it at 0", param=key)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[Any, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list):
        stops = tuple(stop)
    else:
        stops = (None,)  # refused below
    if len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "stop must be a string or a list of up to 4 non-empty strings", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):  # each token is checked against every one's prefixes
        raise APIError(400, f"a stop string is at most {MAX_STOP_CHARS} characters long", param="stop")
    max_tokens = DEFAULT_MAX_TOKENS
    for key in ("max_tokens", "max_completion_tokens"):  # the newer name wins when both are given
        given = _integer(body, key, 1, MAX_TOKENS_LIMIT)
        max_tokens = given if given is not None else max_tokens
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0:
        raise APIError(400, "top_p must be more than 0 and at most 1", param="top_p")
    return SamplingParams(
        temperature=_number(body, "temperature", 0.0, 2.0, 0.7),
        top_p=top_p,
        max_tokens=max_tokens,
        seed=_integer(body, "seed", -(2**63), 2**63 - 1),
        stop=stops,
    )


def parse_stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage), each a JSON boolean or absent."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise APIError(400, "stream must be true or false", param="stream")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "stream_options must be an object", param="stream_options")
    include = (options or {}).get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise APIError(400, "stream_options.include_usage must be true or false", param="stream_options")
    return bool(stream), bool(include)


def wanted_model(requested: Any, current: tuple[str, str] | None) -> tuple[str | None, str]:
    """(backend or None: pick one, model) that should answer `requested`; raises for an unknown model."""
    name = str(requested or "").strip()
    if name.lower() in ANY_MODEL or (current and name in (current[1], f"{current[0]}:{current[1]}")):
        if current is None:
            raise APIError(
                503, "no model is loaded: name an installed one (GET /v1/models lists them)", "server_error",
                "model_not_loaded",
            )  # fmt: skip
        return current
    installed = {m.name for m in list_models()}
    if name in installed:
        return None, name
    backend, _, model = name.partition(":")
    if model in installed and backend in available_backends():
        return backend, model
    try:  # the start of one installed name, as `/model qwen` and `--model qwen` take it
        found = installed_by_start(name) if name else None
    except ModelNotFoundError as exc:  # the start of several
        raise APIError(404, str(exc), param="model", code="model_not_found") from None
    if found is not None:
        return None, found.name
    raise APIError(
        404,
        f"model '{name}' does not exist: GET /v1/models lists the installed ones"
        + (f"; '{current[1]}' is loaded" if current else ""),
        param="model",
        code="model_not_found",
    )


async def read_body(request: Request) -> dict[str, Any]:
    """The request's JSON object, read up to MAX_BODY_BYTES and no further (an 800 MB body was held in
    memory whole before it was refused)."""
    too_big = APIError(413, f"request body over {MAX_BODY_BYTES >> 20} MB")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_big
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the body is not JSON flashcode reads: it nests too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


async def check_context(worker: Worker, messages: tuple[Message, ...]) -> None:
    n, ctx = await worker.acall(lambda b: (len(b.apply_chat_template(messages)), int(b.context_length or 0)))
    if ctx and n >= ctx:
        raise APIError(
            400,
            f"the messages are {n} tokens and the model's context is {ctx}: shorten them",
            param="messages",
            code="context_length_exceeded",
        )


class Completion:
    """One request: run it on the worker, shape the result, record its stats."""

    def __init__(self, gen: Generation, backend: str, model: str, record: ReplyRecorder) -> None:
        self.gen, self.record_stats = gen, record
        self.backend, self.model = backend, model
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def usage(self, done: Done) -> dict[str, Any]:
        s = done.stats
        return {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
        }

    def record_cut(self) -> None:
        """The client went away before the end: the reply is cancelled, and its numbers (what the engine had
        read and written until it stopped) are recorded once the engine's own end arrives."""
        self.gen.cancel()

        async def when_done() -> None:
            for _ in range(
                600
            ):  # the engine stops at its next token; a stuck one is not waited for past 60 s
                if (own := self.gen.engine_done) is not None:
                    self.record(replace(own, finish_reason="cancelled"))
                    return
                await asyncio.sleep(0.1)

        task = asyncio.get_running_loop().create_task(when_done())
        _background.add(task)
        task.add_done_callback(_background.discard)

    def record(self, done: Done) -> None:
        stats = done.stats.to_dict() | {
            "backend": self.backend,
            "model": self.model,
            "finish_reason": done.finish_reason,
        }
        try:
            self.record_stats(stats)
        except Exception:  # noqa: BLE001 - a stats failure must not fail the reply
            log.exception("could not record API reply stats")

    async def whole(self) -> Response:
        gen = self.gen
        parts: list[str] = []
        reasoning: list[str] = []
        done: Done | None = None
        try:
            async for ev in gen:
                if isinstance(ev, TextDelta):
                    (reasoning if ev.kind == "reasoning" else parts).append(ev.text)
                else:
                    done = ev
        finally:
            if done is None:
                self.record_cut()
        assert done is not None
        if done.finish_reason == "error":
            return APIError(500, f"the engine failed: {done.error}", "server_error").response()
        self.record(done)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        return JSONResponse(
            {
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": f"flashcode-{self.backend}",
                "choices": [
                    {"index": 0, "message": message, "finish_reason": finish_reason(done), "logprobs": None}
                ],
                "usage": self.usage(done),
            }
        )

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        data = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": f"flashcode-{self.backend}",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        return sse(data)

    async def sse(self, include_usage: bool) -> AsyncIterator[str]:
        gen = self.gen
        done: Done | None = None
        try:
            yield self.chunk({"role": "assistant", "content": ""})
            async for ev in gen:
                if isinstance(ev, TextDelta):
                    if ev.text:
                        key = "reasoning_content" if ev.kind == "reasoning" else "content"
                        yield self.chunk({key: ev.text})
                else:
                    done = ev
        finally:
            if done is None:  # the client went away: stop the engine at its next token, count what it did
                self.record_cut()
        assert done is not None
        if done.finish_reason == "error":
            yield sse(
                {
                    "error": {
                        "message": f"the engine failed: {done.error}",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                }
            )
        else:
            self.record(done)
            yield self.chunk({}, finish_reason(done))
            if include_usage:
                yield sse(
                    {
                        "id": self.id,
                        "object": "chat.completion.chunk",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": self.usage(done),
                    }
                )
        yield "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def finish_reason(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


class OpenAIAPI:
    """The `/v1` routes of one app, over its `engine`; `record` gets each reply's numbers."""

    def __init__(self, engine: EngineState, record: ReplyRecorder) -> None:
        self.engine, self.record = engine, record

    @property
    def worker(self) -> Worker:
        return self.engine.worker

    @property
    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.retrieve_model, methods=["GET"]),
            Route("/v1/{rest:path}", self.unknown, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
        ]

    async def unknown(self, request: Request) -> Response:
        """Any other /v1 path: OpenAI's 404 shape (a client reads `error.message`, not a text page)."""
        try:
            check_access(request)
        except APIError as exc:
            return exc.response()
        path = request.url.path
        return APIError(
            404, f"{request.method} {path} is not part of flashcode's API: it has POST /v1/chat/completions "
            "and GET /v1/models", "invalid_request_error", "unknown_url",
        ).response()  # fmt: skip

    async def retrieve_model(self, request: Request) -> Response:
        """GET /v1/models/ID: one installed model (`models.retrieve`), or 404 model_not_found."""
        try:
            check_access(request)
        except APIError as exc:
            return exc.response()
        wanted = request.path_params["model_id"]
        found = next((m for m in self.models() if m["id"] == wanted), None)
        if found is not None:
            return JSONResponse(found)
        return APIError(
            404, f"model '{wanted}' does not exist: GET /v1/models lists the installed ones",
            param="model", code="model_not_found",
        ).response()  # fmt: skip

    async def load(self, backend: str | None, model: str) -> tuple[str, str]:
        """With the engine's lock held: `model` loaded (on `backend`, or where it fits) unless it is."""
        current = loaded(self.worker)
        if current and current[1] == model and backend in (None, current[0]):
            return current
        if backend is None:
            backend = await asyncio.to_thread(self.engine.placement, model)
        log.info("/v1: loading %s on %s for a request", model, backend)
        try:
            await self.engine.switch_locked(backend, model)
        except Exception as exc:  # noqa: BLE001 - said to the client; the engine restored what it had
            raise APIError(503, f"could not load '{model}' on {backend}: {exc}", "server_error",
                           "model_load_failed") from None  # fmt: skip
        now = loaded(self.worker)
        assert now is not None
        return now

    async def chat_completions(self, request: Request) -> Response:
        try:
            check_access(request)
            body = await read_body(request)
            messages = parse_messages(body.get("messages"))
            sampling = parse_sampling(body)
            stream, include_usage = parse_stream(body)
            async with self.engine.lock:  # no switch between the model check and the queued generation
                want_backend, want_model = wanted_model(body.get("model"), loaded(self.worker))
                backend, model = await self.load(want_backend, want_model)
                await check_context(self.worker, messages)
                req = GenerationRequest(messages=messages, sampling=sampling)
                gen = self.worker.submit(req, loop=asyncio.get_running_loop())
        except APIError as exc:
            return exc.response()
        except EngineError as exc:  # the engine could not even template the messages
            return APIError(500, f"the engine failed: {exc}", "server_error").response()
        call = Completion(gen, backend, model, self.record)
        if stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(call.sse(include_usage), media_type="text/event-stream", headers=headers)
        return await call.whole()

    async def list_models(self, request: Request) -> Response:
        try:
            check_access(request)
        except APIError as exc:
            return exc.response()
        return JSONResponse({"object": "list", "data": self.models()})

    def models(self) -> list[dict[str, Any]]:
        """Every installed model (and the loaded one, if it is not installed) as OpenAI lists models."""
        b = self.worker.backend
        backend = b.name if b is not None else None
        current = b.model.name if b is not None and b.model is not None else None
        models = list_models()
        names = [m.name for m in models]
        created = {m.name: int(m.path.stat().st_mtime) if m.path.exists() else 0 for m in models}
        if current and current not in names:
            names.insert(0, current)
        return [
            {
                "id": n,
                "object": "model",
                "created": created.get(n, 0),
                "owned_by": f"flashcode-{backend or 'none'}",
                "loaded": n == current,
            }
            for n in names
        ]
