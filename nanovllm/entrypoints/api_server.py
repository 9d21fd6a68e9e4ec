"""An OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn): `nanovllm serve MODEL`.

    GET  /health                 200 once the engine is loaded (503 if it has failed)
    GET  /v1/models              the served model
    POST /v1/completions         prompt(s) -> text, streamed as server-sent events on request
    POST /v1/chat/completions    messages, rendered by the tokenizer's chat template
    GET  /metrics                Prometheus metrics (entrypoints/metrics.py)

An RL trainer's operations on the engine (behind the API key too; each answers {"success": true, ...}):

    POST /update_weights_from_disk  {"model_path": DIR}: its *.safetensors into the model, between calls
    POST /reset_prefix_cache        every cached prefix forgotten
    POST /sleep                     {"level": 1 | 2} (optional): the KV cache (and, 2, the weights) freed
    POST /wake_up                   {"tags": ["weights", "kv_cache"]} (optional): back from sleep
    GET  /is_sleeping               {"is_sleeping": bool}

A weight update waits for the requests in the engine to finish on the old weights and holds back those
that come meanwhile, which then run on the new ones: no response mixes two versions of the weights (see
async_engine.Operation). A bad checkpoint is a 400, and the old weights go on serving. From /sleep until
the engine is awake, a completion is a 503 with Retry-After.

Concurrent requests share the engine's continuous batching (entrypoints/async_engine.py). Errors have
OpenAI's shape, {"error": {"message", "type", "param", "code"}}: a client's mistake is a 4xx naming the
field, never a 500, and never disturbs the other requests.

Shutdown (SIGTERM or SIGINT) refuses new requests and aborts those in flight: a response not started yet
(an upload too, within SHUTDOWN_GRACE seconds) is a 503 with Retry-After: 1, a stream under way ends with
an {"error": ...} event and `data: [DONE]`. (The engine's finish_reason "abort" is never reported.)
"""
import asyncio
import dataclasses
import functools
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator

import torch
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.engine.frontend import PromptTooLong
from nanovllm.entrypoints.args import llm_from_args, options_from_args
from nanovllm.entrypoints.async_engine import (AsyncEngine, Asleep, ChatPrompt, EngineDead, QueueFull, ShuttingDown,
                                               TooLarge, Unsupported, updates)
from nanovllm.features.structured_outputs import grammar_threads, import_xgrammar
from nanovllm.entrypoints.metrics import ServingMetrics
from nanovllm.entrypoints.media import ImageURLs
from nanovllm.entrypoints.reasoning_parsers import REASONING_PARSERS, ReasoningStream
from nanovllm.entrypoints.tool_parsers import TOOL_PARSERS
from nanovllm.entrypoints.protocol import (BadRequest, ChatCompletionRequest, CompletionRequest, ErrorResponse,
                                           ResetPrefixCacheRequest, SamplingRequest, SleepRequest,
                                           UpdateWeightsFromDiskRequest, WakeUpRequest, inline_schema, parse_body)

logger = logging.getLogger(__name__)

CREATED = int(time.time())  # the served model's `created`
SHUTDOWN_GRACE = 0.5  # seconds a request still uploading is given, once shutdown starts
RETRY_AFTER = {"Retry-After": "1"}
DISCARD_LIMIT = 64 * 2**20  # the most of a refused body the Gate reads (to drop it) before it answers
MAX_ERROR_MESSAGE = 2000  # characters of an error message (the rest is cut): what it says is in its start


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        if len(message) > MAX_ERROR_MESSAGE:  # (a message quoting what the client sent: 400,000 stop strings)
            message = message[:MAX_ERROR_MESSAGE] + " ..."
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status, headers=self.headers)


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down: the request was not completed; retry on another server",
                    "service_unavailable", headers=RETRY_AFTER)


# ---- errors: every one in OpenAI's shape ---------------------------------------------------------
def internal_error() -> APIError:
    return APIError(500, "the server failed to answer this request (a bug: its log has the traceback)", "server_error")


async def error_response(_, e: Exception) -> JSONResponse:
    """The app's handler of these errors; a bug of ours still answers in OpenAI's shape (Starlette logs it)."""
    if isinstance(e, BadRequest):
        e = APIError(e.status, str(e), "invalid_request_error", e.param)
    elif isinstance(e, StarletteHTTPException):
        e = APIError(e.status_code, str(e.detail), "invalid_request_error")
    elif not isinstance(e, APIError):
        e = internal_error()
    return e.response()


HANDLED_ERRORS = (APIError, BadRequest, StarletteHTTPException, Exception)  # (Exception: Starlette's 500 handler)
ERRORS = {status: {"model": ErrorResponse, "description": description} for status, description in (
    (400, "A bad request: the error's `param` names the field"), (401, "A missing or wrong API key"),
    (404, "An unknown model"), (413, "A body over --max-request-bytes"), (415, "A body that is not JSON"),
    (503, "Too many sequences waiting, the engine asleep, or the server shutting down (Retry-After says when "
          "to retry)"))}


class Gate:
    """ASGI middleware deciding before the body is parsed: 401 for a /v1 request (or an engine operation's,
    ADMIN_PATHS) without the API key, 413
    for a body over max_request_bytes (neither read into memory), 503 within SHUTDOWN_GRACE for an upload
    under way at shutdown. A refused body is still read (up to DISCARD_LIMIT) and dropped, as clients see a
    reset if we close mid-upload; not after "Expect: 100-continue" (the client waits for our word)."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int):
        self.app, self.api_key, self.max_request_bytes = app, api_key, max_request_bytes
        self.stopping: float | None = None  # when shutdown started (time.monotonic()), from Server.handle_exit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        discard = DISCARD_LIMIT if "100-continue" not in headers.get("expect", "").lower() else 0
        if (scope["path"].startswith("/v1") or scope["path"] in ADMIN_PATHS) and not self._authorized(headers):
            return await self._refuse(APIError(401, "missing or invalid API key: send Authorization: Bearer <key>",
                                               "authentication_error", code="invalid_api_key"), discard,
                                      scope, receive, send)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            return await self._refuse(self._too_large(int(declared)), discard, scope, receive, send)
        body, more, ended = await self._read(receive, self.max_request_bytes)
        if more is None:
            return await shutting_down().response()(scope, receive, send)
        if more:  # (nothing left to drop when the message past the limit was the body's last)
            return await self._refuse(self._too_large(len(body) + len(more)), 0 if ended else DISCARD_LIMIT,
                                      scope, receive, send)
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():  # the body first, then the connection's own messages (a disconnect)
            return pending.pop() if pending else await receive()
        await self.app(scope, replay, send)

    def _authorized(self, headers: dict) -> bool:
        return self.api_key is None or secrets.compare_digest(headers.get("authorization", "").encode(),
                                                              f"Bearer {self.api_key}".encode())

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"the body is {size} bytes, more than the {self.max_request_bytes} this server takes "
                             "(--max-request-bytes)", "invalid_request_error")

    async def _refuse(self, error: APIError, discard: int, scope, receive, send):
        """Answer with error, after reading up to `discard` bytes of the body and dropping them."""
        if discard:
            await self._read(receive, discard, keep=False)
        await error.response()(scope, receive, send)

    async def _read(self, receive, limit: int, keep: bool = True) -> tuple[bytes, bytes | None, bool]:
        """The body up to limit bytes (kept, or dropped), what came past it (b""; None: shutdown's grace ran
        out), and whether its last message was read: a refusal must then wait for no more (none would come)."""
        chunks, size = [], 0
        while True:
            message = await self._receive(receive)
            if message is None:
                return b"", None, True
            if message["type"] == "http.disconnect":
                return b"".join(chunks), b"", True
            chunk = message.get("body", b"")
            ended = not message.get("more_body", False)
            if size + len(chunk) > limit:
                return b"".join(chunks), chunk, ended
            size += len(chunk)
            if keep:
                chunks.append(chunk)
            if ended:
                return b"".join(chunks), b"", True

    async def _receive(self, receive) -> dict | None:
        """The connection's next message, or None once shutdown has gone on for SHUTDOWN_GRACE."""
        message = asyncio.ensure_future(receive())
        while True:
            left = None if self.stopping is None else self.stopping + SHUTDOWN_GRACE - time.monotonic()
            done, _ = await asyncio.wait({message}, timeout=0.1 if left is None else max(0.0, left))
            if done:
                return message.result()
            if left is not None:
                message.cancel()
                return None


# ---- the endpoints: what they serve is in app.state (see build_app) ------------------------------
public = APIRouter()
v1 = APIRouter(prefix="/v1")  # the API: behind the key, if any (the Gate checks it)
admin = APIRouter()  # the engine operations: behind the key too (ADMIN_PATHS)


@public.get("/health")
async def health(http: Request):
    engine = http.app.state.engine
    if engine.error is not None:
        return APIError(503, f"the engine has failed: {engine.error!r}", "server_error").response()
    return Response(status_code=200)


public.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)  # (what load balancers may send)


@public.get("/metrics")
async def prometheus_metrics(http: Request):
    metrics = http.app.state.metrics
    if metrics is None:
        raise APIError(404, "metrics are off", "not_found_error")
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


@functools.lru_cache(maxsize=4)
def vocabulary_bytes(tokenizer) -> list[bytes]:
    """Each token id's own bytes, as xgrammar reads them from a tokenizer's vocabulary (any encoding)."""
    return import_xgrammar().TokenizerInfo.from_huggingface(tokenizer).decoded_vocab


def token_bytes(tokenizer, token_id: int) -> bytes:
    table = vocabulary_bytes(tokenizer)
    return bytes(table[token_id]) if token_id < len(table) else b""


def model_card(state) -> dict:
    return {"id": state.served_model_name, "object": "model", "created": CREATED, "owned_by": "nanovllm",
            "max_model_len": state.engine.llm.config.max_model_len}


@v1.get("/models", responses={401: ERRORS[401]})
async def models(http: Request):
    return {"object": "list", "data": [model_card(http.app.state)]}


def check_model(model: str | None, served_model_name: str):
    """A 404 for a model that this server does not serve (None: the request named none)."""
    if model is not None and model != served_model_name:
        raise APIError(404, f"the model `{model}` does not exist; this server serves `{served_model_name}`",
                       "not_found_error", "model", "model_not_found")


@v1.get("/models/{model_id:path}", responses={401: ERRORS[401], 404: ERRORS[404]})
async def model(model_id: str, http: Request):
    check_model(model_id, http.app.state.served_model_name)
    return model_card(http.app.state)


def body_of(model: type[SamplingRequest]) -> dict:
    """The OpenAPI description of an endpoint whose body (parsed by parse_body, not FastAPI) is `model`."""
    return {"openapi_extra": {"requestBody": {"required": True, "content": {
        "application/json": {"schema": inline_schema(model)}}}}, "responses": ERRORS}


@v1.post("/completions", **body_of(CompletionRequest))
async def completions(http: Request):
    body = parse_body(await http.body(), http.headers.get("content-type"), CompletionRequest)
    return await respond(http, body, body.prompts(), body.logprobs, CompletionChoices)


@v1.post("/chat/completions", **body_of(ChatCompletionRequest))
async def chat_completions(http: Request):
    body = parse_body(await http.body(), http.headers.get("content-type"), ChatCompletionRequest)
    state = http.app.state
    body.use_parsers(state.tool_parser, state.reasoning_parser)
    messages = [m.as_template_input() for m in body.messages]
    try:  # (here, to name the field: rendering checks them too)
        state.engine.llm.check_chat_template_kwargs(body.chat_template_kwargs or {})
    except ValueError as e:
        raise BadRequest(str(e), "chat_template_kwargs") from e
    prompt = ChatPrompt(messages, body.tool_definitions(), body.chat_template_kwargs)
    return await respond(http, body, [prompt], body.num_logprobs(),
                         functools.partial(ChatChoices, reasoning_parser=state.reasoning_parser))


# ---- an RL trainer's operations on the engine (async_engine.AsyncFront.operate runs them) ----------
# (Their bodies are described in each endpoint's docstring, not as an OpenAPI requestBody: the document's
# request bodies are the API's, which the fuzz tests draw from: tests/openapi_strategy.py.)
ADMIN_ERRORS = {**{status: ERRORS[status] for status in (400, 401, 413, 415, 503)},
                501: {"model": ErrorResponse, "description": "An engine that cannot run it (data parallel)"}}


def optional_body(raw: bytes, content_type: str | None, model: type):
    """The body as `model`, each field its default where none was sent (an empty body: all of them)."""
    return parse_body(raw, content_type, model) if raw.strip() else model()


async def operate(http: Request, operation, param: str | None, answer):
    """answer(operation's result) (operation: a coroutine of the engine's); its ValueError/TypeError a 400
    naming param."""
    try:
        result = await until_disconnected(http, operation)
    except ClientGone:
        return Response(status_code=499)  # (nobody reads it; not run, if it was still waiting for its turn)
    except (ValueError, TypeError) as e:  # (checked before anything changed: the engine serves as before)
        raise BadRequest(str(e), param) from e
    except Unsupported as e:
        raise APIError(501, str(e), "not_implemented_error") from e
    return answer(result)


@admin.post("/update_weights_from_disk", responses=ADMIN_ERRORS)
async def update_weights_from_disk(http: Request):
    """`{"model_path": DIR}`: every tensor of DIR's *.safetensors into the model, once the requests in flight
    have finished (those that come meanwhile wait, and run on the new weights); the prefix cache is reset.
    Answers `{"success": true, "num_loaded": N}` (parameter loads); a bad folder or tensor is a 400, the old
    weights serving on."""
    body = parse_body(await http.body(), http.headers.get("content-type"), UpdateWeightsFromDiskRequest)
    return await operate(http, http.app.state.engine.update_weights_from_disk(body.model_path), "model_path",
                         lambda num_loaded: {"success": True, "num_loaded": num_loaded})


@admin.post("/reset_prefix_cache", responses=ADMIN_ERRORS)
async def reset_prefix_cache(http: Request):
    """No body (or `{}`): every cached prefix forgotten, between requests. Answers `{"success": true}`."""
    optional_body(await http.body(), http.headers.get("content-type"), ResetPrefixCacheRequest)
    return await operate(http, http.app.state.engine.reset_prefix_cache(), None, lambda _: {"success": True})


@admin.post("/sleep", responses=ADMIN_ERRORS)
async def sleep(http: Request):
    """`{"level": 1}` (the default; 2: the weights dropped too, reloaded from the checkpoint at wake-up), or no
    body: once the requests queued have finished, the KV cache is freed; until /wake_up, a completion is a 503
    with Retry-After. Answers `{"success": true, "is_sleeping": true}`."""
    body = optional_body(await http.body(), http.headers.get("content-type"), SleepRequest)
    engine = http.app.state.engine
    return await operate(http, engine.sleep(body.level), "level",
                         lambda _: {"success": True, "is_sleeping": engine.asleep > 0})


@admin.post("/wake_up", responses=ADMIN_ERRORS)
async def wake_up(http: Request):
    """`{"tags": ["weights", "kv_cache"]}` (a subset; none given: both), or no body: back from /sleep (awake,
    a no-op). Answers `{"success": true, "is_sleeping": bool}`: true still after the weights alone."""
    body = optional_body(await http.body(), http.headers.get("content-type"), WakeUpRequest)
    engine = http.app.state.engine
    return await operate(http, engine.wake_up(body.tags), "tags",  # (still asleep after tags=["weights"])
                         lambda _: {"success": True, "is_sleeping": engine.asleep > 0})


@admin.get("/is_sleeping", responses={401: ERRORS[401]})
async def is_sleeping(http: Request):
    """`{"is_sleeping": bool}`, as vLLM's."""
    return {"is_sleeping": http.app.state.engine.asleep > 0}


ADMIN_PATHS = frozenset(route.path for route in admin.routes)


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None,
              metrics: ServingMetrics | None, max_request_bytes: int, tool_call_parser: str = "hermes",
              reasoning_parser: str | None = None) -> Gate:
    """The FastAPI app (`.app`) serving `engine` as `served_model_name`, behind its Gate."""
    app = FastAPI(title="nanovllm", docs_url=None, redoc_url=None)
    app.state.engine, app.state.served_model_name, app.state.metrics = engine, served_model_name, metrics
    app.state.tool_parser = TOOL_PARSERS[tool_call_parser]()
    app.state.reasoning_parser = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
    for error in HANDLED_ERRORS:
        app.add_exception_handler(error, error_response)
    app.include_router(public)
    app.include_router(v1)
    app.include_router(admin)
    return Gate(app, api_key, max_request_bytes)


# ---- one API call -------------------------------------------------------------------------------
async def submit_all(engine: AsyncEngine, prompts: list, body: SamplingRequest, num_logprobs: int | None) -> list:
    """Tokenize the prompts, compile the grammar (each on its threads), limit each completion, and queue them, all
    or none (nothing if cancelled); a refusal is a BadRequest naming the field, or a 503 (until_disconnected)."""
    try:
        engine.check_open()  # (before tokenizing for nothing)
        engine.check_awake()
        params = await sampling_params(engine, body, num_logprobs)
        prompt_ids = await asyncio.gather(*(engine.encode(prompt) for prompt in prompts))
    except PromptTooLong as e:
        raise BadRequest(f"{body.prompt_field} has {e.num_tokens} tokens or more, which leaves no room to "
                         f"generate within max_model_len={engine.llm.config.max_model_len}", body.prompt_field) from e
    except BadRequest:
        raise
    except (ValueError, TypeError) as e:
        raise BadRequest(str(e), body.prompt_field) from e
    params = body.for_prompts(params, prompt_ids, engine.llm.tokenizer)
    try:
        await engine.compile_grammar(params)  # (off the engine's thread: it finds the grammar in its cache)
    except ValueError as e:
        raise (body.bad_request(e) if "SamplingParams." in str(e) else BadRequest(str(e), body.structured_field)) from e
    params = [with_limit(params, len(ids), body, engine.llm.config.max_model_len) for ids in prompt_ids]
    try:
        return engine.submit_all(prompt_ids, params, body.stream)
    except TooLarge as e:
        raise BadRequest(str(e), "n" if body.n > 1 else body.prompt_field) from e
    except (ValueError, TypeError) as e:
        raise body.bad_request(e) from e


async def sampling_params(engine: AsyncEngine, body: SamplingRequest, num_logprobs: int | None):
    """The call's SamplingParams; a required tool call's grammar (slow for deep schemas): on a grammar thread."""
    if not body.requires_tool_call():
        return body.sampling_params(num_logprobs)
    job = grammar_threads().submit(body.sampling_params, num_logprobs)
    try:
        return await engine.grammar_job(job, "tools: building the grammar of their calls")
    except BadRequest:
        raise
    except ValueError as e:  # (the time limit)
        raise BadRequest(str(e), "tools") from e


def with_limit(params, num_prompt_tokens: int, body: SamplingRequest, max_model_len: int):
    """params with the request's completion limit (fitting in max_model_len), or what the prompt leaves."""
    limit, room = body.completion_limit(), max_model_len - num_prompt_tokens
    prompt, field = body.prompt_field, body.max_tokens_field
    if room < 1:
        raise BadRequest(f"{prompt} has {num_prompt_tokens} tokens, which leaves no room to generate within "
                         f"max_model_len={max_model_len}", prompt)
    if limit is not None and limit > room:
        raise BadRequest(f"{prompt} has {num_prompt_tokens} tokens; with {field}={limit} that exceeds "
                         f"max_model_len={max_model_len} (at most {room} tokens can be generated)", field)
    if limit is None:
        try:
            return dataclasses.replace(params, max_tokens=room)
        except (ValueError, TypeError) as e:
            raise body.bad_request(e) from e
    return params


def unavailable(e: Exception) -> APIError:
    if isinstance(e, ShuttingDown):
        return shutting_down()
    if isinstance(e, QueueFull):
        return APIError(503, str(e), "service_unavailable", headers=RETRY_AFTER)
    if isinstance(e, Asleep):
        return APIError(503, f"{e} (POST /wake_up)", "service_unavailable", headers=RETRY_AFTER)
    return APIError(503, str(e), "server_error")  # EngineDead: retrying here will not help


async def respond(http: Request, body: SamplingRequest, prompts: list, num_logprobs: int | None,
                  choices: "type[Choices] | functools.partial"):
    """Submit the call's prompts and answer with their choices, whole or streamed (none if the client left)."""
    engine, name = http.app.state.engine, http.app.state.served_model_name
    check_model(body.model, name)
    try:
        requests = await until_disconnected(http, submit_all(engine, prompts, body, num_logprobs))
        response = choices(requests, body, name, engine.llm.tokenizer)
        if body.stream:
            return StreamingResponse(sse(response.stream(), lambda: abort(engine, requests)),
                                     media_type="text/event-stream")
        try:
            return await until_disconnected(http, response.collect())
        finally:
            abort(engine, requests)
    except ClientGone:
        return Response(status_code=499)  # (nginx's "client closed request": nobody reads it)


def abort(engine: AsyncEngine, requests: list):
    """End whatever of these requests is unfinished (a no-op for finished ones)."""
    for request in requests:
        engine.abort(request)


class ClientGone(Exception):
    """The client disconnected before its answer started."""


async def until_disconnected(http: Request, work):
    """`work`'s result; ClientGone (work cancelled) if the client leaves first; a 503 if the engine cannot serve."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await http.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # (cancel() only asks)
    if task.cancelled():
        raise ClientGone
    try:
        return task.result()
    except (QueueFull, ShuttingDown, EngineDead, Asleep) as e:
        raise unavailable(e) from e


async def sse(events: AsyncIterator[dict], on_close) -> AsyncIterator[str]:
    """Server-sent events, one `data:` line per JSON object, then `data: [DONE]`; on_close runs however it ends."""
    try:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except (EngineDead, APIError) as e:
            error = e if isinstance(e, APIError) else unavailable(e)
            yield f"data: {json.dumps(error.body(), ensure_ascii=False)}\n\n"
        except Exception:  # a bug of ours: this stream still ends as every other one does
            logger.exception("a stream failed")
            yield f"data: {json.dumps(internal_error().body())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        on_close()


class Choices:
    """The choices of one call, n per prompt (index = prompt * n + sample); subclasses give them their shape."""
    id_prefix: str     # of the response's id
    object: str        # of the whole response
    chunk_object: str  # of each streamed chunk

    def __init__(self, requests: list, body: SamplingRequest, model: str, tokenizer):
        self.requests, self.body, self.model, self.tokenizer = requests, body, model, tokenizer
        self.n = body.n
        self._token_texts: dict[int, str] = {}
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    # ---- the endpoint's shape ---------------------------------------------------------------
    def logprobs(self, token_ids: list[int], entries: list[dict] | None, text_offset: int) -> dict | None:
        """The logprobs of these tokens (entries: the engine's {token id: logprob} per token) in
        the endpoint's shape; text_offset: the characters of the choice sent before them."""
        raise NotImplementedError

    def echo(self, c: int, texts: dict, ids: dict, entries: dict, finals: dict, prompt_entries: list | None):
        """Completions' echo: choice c's text, tokens and logprobs with its prompt's first."""

    def final(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """A finished choice's content fields and finish reason (chat: its tool calls parsed)."""
        raise NotImplementedError

    def stream_piece(self, c: int, text: str, finished: bool, finish_reason: str | None
                     ) -> tuple[str, dict, str | None]:
        """What of choice c's new text to stream now, more delta fields, and its finish reason."""
        return text, {}, finish_reason

    def delta(self, text: str) -> dict:
        """The text of a streamed chunk, as its choice holds it."""
        raise NotImplementedError

    def opening(self) -> list[dict]:
        """The choices of the chunk that opens the stream (none: no such chunk)."""
        return []

    # ---- what both share ----------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        """A token's text (memoized: echo's logprobs name the same tokens over and over)."""
        if token_id not in self._token_texts:
            self._token_texts[token_id] = (self.tokenizer.decode([token_id]) if self.tokenizer is not None
                                           else f"token_id:{token_id}")
        return self._token_texts[token_id]

    def _bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (a token holding part of a UTF-8 character decodes to U+FFFD)."""
        return list(token_bytes(self.tokenizer, token_id)) if self.tokenizer is not None else []

    def _ranked(self, token_ids: list[int], entries: list[dict], k: int) -> list[tuple[str, float, list]]:
        """(token text, logprob, the k most likely (token id, logprob)) per token; (text, None, None): echo's first."""
        return [(self._token(token_id), entry[token_id], sorted(entry.items(), key=lambda item: -item[1])[:k])
                if entry is not None else (self._token(token_id), None, None)
                for token_id, entry in zip(token_ids, entries)]

    def usage(self, finals: dict[int, dict]) -> dict:
        prompt_tokens = sum(len(r.prompt_token_ids) for r in self.requests)
        completion_tokens = sum(f["num_tokens"] for f in finals.values())
        cached = sum(finals[i * self.n]["num_cached_tokens"] for i in range(len(self.requests))
                     if i * self.n in finals)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _updates(self) -> AsyncIterator[tuple[int, dict]]:
        """The engine's updates of these requests. Only shutdown aborts a request still read: a 503."""
        async for i, update in updates(self.requests):
            if update.get("finish_reason") == "abort":
                raise shutting_down()
            if update.get("finish_reason") == "error":  # (the engine's word for a row with no token left)
                raise APIError(400, f"choice {i * self.n + update['sample']}: no next token met this request's "
                               "constraints (its structured_outputs and allowed_token_ids had none in common)",
                               "invalid_request_error", "allowed_token_ids")
            yield i, update

    async def collect(self) -> JSONResponse:
        """The whole response, built and encoded on a worker thread: echo's logprobs make megabytes of it."""
        texts, ids, entries, finals = {}, {}, {}, {}  # per choice: its text pieces, tokens, logprobs, end
        prompt_entries = {}  # per request: its prompt logprobs (echo)
        async for i, update in self._updates():
            c = i * self.n + update["sample"]
            texts.setdefault(c, []).append(update["text"] or "")
            ids.setdefault(c, []).extend(update["token_ids"])
            if "logprobs" in update:
                entries.setdefault(c, []).extend(update["logprobs"])
            if "prompt_logprobs" in update:
                prompt_entries[i] = update["prompt_logprobs"]
            if update["finished"]:
                finals[c] = {"num_tokens": len(ids[c]), "num_cached_tokens": update["num_cached_tokens"],
                             "finish_reason": update["finish_reason"], "stop_reason": update["stop_reason"]}
        return await asyncio.to_thread(self._response, texts, ids, entries, finals, prompt_entries)

    def _response(self, texts: dict, ids: dict, entries: dict, finals: dict, prompt_entries: dict) -> JSONResponse:
        for c in finals:
            self.echo(c, texts, ids, entries, finals, prompt_entries.get(c // self.n))
        choices = []
        for c in sorted(finals):
            content, finish_reason = self.final("".join(texts[c]), finals[c]["finish_reason"])
            choices.append({"index": c, "logprobs": self.logprobs(ids[c], entries.get(c), 0),
                            "finish_reason": finish_reason, "stop_reason": finals[c]["stop_reason"], **content})
        return JSONResponse({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                             "choices": choices, "usage": self.usage(finals)})

    async def stream(self) -> AsyncIterator[dict]:
        """The response as chunks: the opening chunk if any, text deltas, usage last if stream_options asks."""
        include_usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        lengths, num_tokens, finals = {}, {}, {}  # per choice: characters sent (text_offset), tokens, end

        def chunk(choices: list[dict]) -> dict:
            return {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                    "choices": choices, **({"usage": None} if include_usage else {})}

        if opening := self.opening():
            yield chunk(opening)
        async for i, update in self._updates():
            c = i * self.n + update["sample"]
            text, extra, finish_reason = self.stream_piece(c, update["text"] or "", update["finished"],
                                                           update.get("finish_reason"))
            num_tokens[c] = num_tokens.get(c, 0) + len(update["token_ids"])
            if not text and not any(extra.values()) and not update["finished"] and "logprobs" not in update:
                continue  # (its tokens' text is held back: an unfinished character or stop string)
            logprobs = self.logprobs(update["token_ids"], update.get("logprobs"), lengths.get(c, 0))
            lengths[c] = lengths.get(c, 0) + len(text)
            choice = {"index": c, **self.delta(text, **extra), "logprobs": logprobs,
                      "finish_reason": finish_reason if update["finished"] else None}
            if update["finished"]:
                finals[c] = {"num_tokens": num_tokens[c], "num_cached_tokens": update["num_cached_tokens"]}
                choice["stop_reason"] = update["stop_reason"]
            yield chunk([choice])
        if include_usage:
            yield {**chunk([]), "usage": self.usage(finals)}


class CompletionChoices(Choices):
    """/v1/completions: each choice's `text`; logprobs as parallel lists."""
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"
    body: CompletionRequest

    def echo(self, c: int, texts: dict, ids: dict, entries: dict, finals: dict, prompt_entries: list | None):
        if not self.body.echo:
            return
        if self.body.echo_only:  # (max_tokens 0: the one token the engine generated is left out)
            texts[c], ids[c], finals[c]["num_tokens"], finals[c]["finish_reason"] = [], [], 0, "length"
            if c in entries:
                entries[c] = []
        prompt_ids = self.requests[c // self.n].prompt_token_ids
        texts[c] = [self.tokenizer.decode(prompt_ids) if self.tokenizer is not None else "", *texts[c]]
        ids[c] = [*prompt_ids, *ids[c]]
        if prompt_entries is not None:
            entries[c] = [*prompt_entries, *(entries.get(c) or [])]

    def logprobs(self, token_ids: list[int], entries: list[dict] | None, text_offset: int) -> dict | None:
        if entries is None:
            return None
        ranked = self._ranked(token_ids, entries, self.body.logprobs)
        offsets = []
        for token, _, _ in ranked:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": [token for token, _, _ in ranked], "token_logprobs": [lp for _, lp, _ in ranked],
                "text_offset": offsets,
                "top_logprobs": [self._top(top) if top is not None else None for _, _, top in ranked]}

    def _top(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """{token text: logprob} of the most likely tokens, a repeated text keyed "token_id:N" (vLLM's)."""
        entries = {}
        for token_id, logprob in top:
            text = self._token(token_id)
            entries[text if text not in entries else f"token_id:{token_id}"] = logprob
        return entries

    def final(self, text: str, finish_reason: str) -> tuple[dict, str]:
        return {"text": text}, finish_reason

    def delta(self, text: str) -> dict:
        return {"text": text}


class ChatChoices(Choices):
    """/v1/chat/completions: each choice's assistant `message`, streamed after a chunk giving each its role."""
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"
    body: ChatCompletionRequest

    def __init__(self, *args, reasoning_parser=None):
        super().__init__(*args)
        self.reasoning_parser = reasoning_parser  # the server's (--reasoning-parser), or None
        self._pending: dict[int, str] = {}  # per choice: text held back (a tool call may start there)
        self._reasoning: dict[int, ReasoningStream] = {}  # per choice: its reasoning / content split

    def logprobs(self, token_ids: list[int], entries: list[dict] | None, text_offset: int) -> dict | None:
        if entries is None:
            return None
        return {"content": [
            {"token": token, "logprob": lp, "bytes": self._bytes(token_id),
             "top_logprobs": [{"token": self._token(i), "logprob": v, "bytes": self._bytes(i)} for i, v in top]}
            for token_id, (token, lp, top) in zip(token_ids, self._ranked(token_ids, entries,
                                                                          self.body.top_logprobs or 0))]}

    def delta(self, text: str, tool_calls: list | None = None, reasoning_content: str | None = None) -> dict:
        delta = {"content": text} if text else {}
        if reasoning_content:
            delta["reasoning_content"] = reasoning_content
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"delta": delta}

    def final(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The message, with reasoning_content (--reasoning-parser) and tool_calls (finishing "tool_calls") parsed."""
        message = {"role": "assistant", "content": text}
        if self.reasoning_parser is not None:
            message["reasoning_content"], message["content"] = self.reasoning_parser.split(
                text, self.body.reasoning_started)
        if self.body.calls_tools():
            content, calls = self.body.tool_parser.parse(message["content"] or "")
            if calls:  # (the text around them, less the space at its ends)
                message.update(content=(content or "").strip() or None, tool_calls=[call.as_api() for call in calls])
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"message": message}, finish_reason

    def stream_piece(self, c: int, text: str, finished: bool, finish_reason: str | None
                     ) -> tuple[str, dict, str | None]:
        """The reasoning (--reasoning-parser) streams as `reasoning_content` deltas; with tools, the content
        streams up to where a call may begin, the rest comes at the end as content and `tool_calls`."""
        extra = {}
        if self.reasoning_parser is not None:
            split = self._reasoning.setdefault(c, ReasoningStream(self.reasoning_parser, self.body.reasoning_started))
            extra["reasoning_content"], text = split.push(text, finished)
        if not self.body.calls_tools():
            return text, extra, finish_reason
        parser, pending = self.body.tool_parser, self._pending.get(c, "") + text
        if not finished:
            cut = parser.held_back(pending)
            self._pending[c] = pending[cut:]
            return pending[:cut], extra, finish_reason
        self._pending.pop(c, None)
        content, calls = parser.parse(pending)
        if not calls:
            return pending, extra, finish_reason
        return ((content or "").rstrip(), {**extra, "tool_calls": [call.as_api(i) for i, call in enumerate(calls)]},
                "tool_calls" if finish_reason == "stop" else finish_reason)  # (the rest of the text, to its end)

    def opening(self) -> list[dict]:
        return [{"index": c, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for c in range(len(self.requests) * self.n)]


class Server(uvicorn.Server):
    """uvicorn's server in front of one engine and its Gate, which it tells when a signal asks to stop."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, gate: Gate, banner: str):
        super().__init__(config)
        self.engine, self.gate, self.banner = engine, gate, banner

    def handle_exit(self, sig, frame):
        """End every request at once, so the graceful shutdown waits only for uploads given SHUTDOWN_GRACE;
        and do not re-raise the signal afterwards (uvicorn would, ending us with its status)."""
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        if self.gate.stopping is None:
            self.gate.stopping = time.monotonic()
            self.engine.close()

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            print(self.banner, flush=True)


def serve(args) -> int:
    """`nanovllm serve`: load the engine, serve until SIGINT or SIGTERM, stop; 0 (1: it never started)."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # On CPU, leave a core to the event loop: torch's intra-op threads spin-wait, and fighting
        # them for every core slows the engine several times over.
        torch.set_num_threads(max(1, torch.get_num_threads() - 1))
    metrics = None if args.no_metrics else ServingMetrics()
    if args.data_parallel_size > 1:  # (replicas of the engine, each a process: distributed/data_parallel.py)
        from nanovllm.distributed.data_parallel import DataParallelEngine
        engine = DataParallelEngine(args.model, options_from_args(args), args.data_parallel_size,
                                    args.data_parallel_routing, args.max_queued_requests, metrics)
    else:
        engine = AsyncEngine(llm_from_args(args), args.max_queued_requests, metrics)
    engine.image_urls = ImageURLs(tuple(args.allowed_media_domains), args.max_image_bytes, args.image_fetch_timeout)
    name = args.served_model_name or args.model
    gate = build_app(engine, name, args.api_key, metrics, args.max_request_bytes, args.tool_call_parser,
                     args.reasoning_parser)
    banner = f"nanovllm: serving {name!r} on http://{args.host}:{args.port} (OpenAI API under /v1)"
    server = Server(uvicorn.Config(gate, host=args.host, port=args.port, log_level=args.log_level,
                                   access_log=not args.disable_log_requests, timeout_graceful_shutdown=5),
                    engine, gate, banner)
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0 if server.started else 1
