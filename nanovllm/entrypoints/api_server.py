"""An OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn): `nanovllm serve MODEL`.

    GET  /health                 200 once the engine is loaded (503 if it has failed)
    GET  /v1/models              the served model
    POST /v1/completions         prompt(s) -> text, streamed as server-sent events on request
    POST /v1/chat/completions    messages, rendered by the tokenizer's chat template
    GET  /metrics                Prometheus metrics (entrypoints/metrics.py)

Concurrent requests share the engine's continuous batching: each HTTP request becomes one engine
request per prompt, and the engine thread (entrypoints/async_engine.py) steps them all together.
Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}; a client's mistake
is a 4xx, never a 500, and never disturbs the other requests.
"""
import asyncio
import json
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator

import torch
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.entrypoints.args import llm_from_args
from nanovllm.entrypoints.async_engine import AsyncEngine, EngineDead, QueueFull, updates
from nanovllm.entrypoints.metrics import ServingMetrics
from nanovllm.entrypoints.protocol import (BadRequest, ChatCompletionRequest, CompletionRequest, SamplingRequest)


CREATED = int(time.time())  # the served model's `created`


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code if self.code is not None else self.status}}, self.status)


# ---- errors: every one in OpenAI's shape ---------------------------------------------------------
async def api_error(_, e: APIError):
    return e.response()


async def bad_request(_, e: BadRequest):
    return APIError(400, str(e), "invalid_request_error", e.param).response()


async def invalid_request(_, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                        "invalid_request_error").response()
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = f"{'.'.join(location) or 'body'}: {first.get('msg', 'invalid request')}"
    return APIError(400, message, "invalid_request_error", location[0] if location else None).response()


async def http_error(_, e: StarletteHTTPException):
    return APIError(e.status_code, str(e.detail), "invalid_request_error").response()


ERROR_HANDLERS = {APIError: api_error, BadRequest: bad_request, RequestValidationError: invalid_request,
                  StarletteHTTPException: http_error}


# ---- the endpoints: what they serve is in app.state (see build_app) ------------------------------
async def authorized(http: Request):
    api_key = http.app.state.api_key
    if api_key is None:
        return
    given = http.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise APIError(401, "missing or invalid API key: send Authorization: Bearer <key>",
                       "authentication_error", code="invalid_api_key")


public = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized)])  # the API: behind the key, if any


@public.get("/health")
async def health(http: Request):
    engine = http.app.state.engine
    if engine.error is not None:
        return APIError(503, f"the engine has failed: {engine.error!r}", "server_error").response()
    return Response(status_code=200)


@public.get("/metrics")
async def prometheus_metrics(http: Request):
    metrics = http.app.state.metrics
    if metrics is None:
        raise APIError(404, "metrics are off", "not_found_error")
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


@v1.get("/models")
async def models(http: Request):
    state = http.app.state
    model = {"id": state.served_model_name, "object": "model", "created": CREATED, "owned_by": "nanovllm",
             "max_model_len": state.engine.llm.config.max_model_len}
    return {"object": "list", "data": [model]}


@v1.post("/completions")
async def completions(body: CompletionRequest, http: Request):
    return await respond(http, body, body.prompts(), body.max_tokens, body.logprobs, CompletionChoices)


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, http: Request):
    messages = [m.as_template_input() for m in body.messages]
    num_logprobs = body.num_logprobs()
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return await respond(http, body, [messages], max_tokens, num_logprobs, ChatChoices)


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              metrics: ServingMetrics | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under the name `served_model_name`: the endpoints above,
    with what they serve in app.state."""
    app = FastAPI(title="nanovllm", docs_url=None, redoc_url=None)
    app.state.engine, app.state.served_model_name = engine, served_model_name
    app.state.api_key, app.state.metrics = api_key, metrics
    for error, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    app.include_router(public)
    app.include_router(v1)
    return app


# ---- one API call -------------------------------------------------------------------------------
def check_model(body: SamplingRequest, served_model_name: str):
    if body.model is not None and body.model != served_model_name:
        raise APIError(404, f"the model `{body.model}` does not exist; this server serves `{served_model_name}`",
                       "not_found_error", "model", "model_not_found")


async def submit_all(engine: AsyncEngine, prompts: list, body: SamplingRequest, max_tokens: int | None,
                     num_logprobs: int | None) -> list:
    """One engine request per prompt, queued together (all of them or none), sharing one
    queue. max_tokens None: up to max_model_len (chat's default)."""
    params = body.sampling_params(max_tokens, num_logprobs)  # (a BadRequest is a 400 naming the field)
    try:
        return await engine.submit_all(prompts, params, body.stream, fill_context=max_tokens is None)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), "invalid_request_error", getattr(e, "param", None)) from e
    except QueueFull as e:
        raise APIError(503, str(e), "service_unavailable") from e
    except EngineDead as e:
        raise APIError(503, str(e), "server_error") from e


async def respond(http: Request, body: SamplingRequest, prompts: list, max_tokens: int | None,
                  num_logprobs: int | None, choices: type["Choices"]):
    """Submit the call's prompts and answer with their choices: a whole response, or a stream."""
    engine, name = http.app.state.engine, http.app.state.served_model_name
    check_model(body, name)
    requests = await submit_all(engine, prompts, body, max_tokens, num_logprobs)
    response = choices(requests, body, name, engine.llm.tokenizer)
    if body.stream:
        return StreamingResponse(sse(response.stream(), lambda: abort(engine, requests)),
                                 media_type="text/event-stream")
    try:
        return await until_disconnected(http, response.collect())
    finally:
        abort(engine, requests)


def abort(engine: AsyncEngine, requests: list):
    """End whatever of these requests is unfinished (a no-op for finished ones)."""
    for request in requests:
        engine.abort(request)


async def until_disconnected(http: Request, work):
    """Run the coroutine `work` and return its result; if the client disconnects first, cancel
    it (the caller aborts its requests) and answer nobody."""
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
        return Response(status_code=499)  # (nginx's "client closed request": nobody reads it)
    try:
        return task.result()
    except EngineDead as e:
        raise APIError(503, str(e), "server_error") from e


async def sse(events: AsyncIterator[dict], on_close) -> AsyncIterator[str]:
    """Server-sent events, one `data:` line per JSON object, ending with `data: [DONE]`. on_close
    runs however it ends (a client that went away cancels this generator)."""
    try:
        async for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    except (EngineDead, APIError) as e:
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error', 'param': None, 'code': 503}})}\n\n"
    finally:
        on_close()


class Choices:
    """The choices of one call, n per prompt (choice index = prompt * n + sample), and what the two
    endpoints' responses share: the id, the usage, and the loops over the engine's updates that
    collect or stream them. CompletionChoices and ChatChoices give the choices their shape."""
    id_prefix: str     # of the response's id
    object: str        # of the whole response
    chunk_object: str  # of each streamed chunk

    def __init__(self, requests: list, body: SamplingRequest, model: str, tokenizer):
        self.requests, self.body, self.model, self.tokenizer = requests, body, model, tokenizer
        self.n = body.n
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    # ---- the endpoint's shape ---------------------------------------------------------------
    def logprobs(self, token_ids: list[int], entries: list[dict] | None, text_offset: int) -> dict | None:
        """The logprobs of these tokens (entries: the engine's {token id: logprob} per token) in
        the endpoint's shape; text_offset: the characters of the choice sent before them."""
        raise NotImplementedError

    def content(self, text: str) -> dict:
        """A whole choice's text, as the response's choice holds it."""
        raise NotImplementedError

    def delta(self, text: str) -> dict:
        """The text of a streamed chunk, as its choice holds it."""
        raise NotImplementedError

    def opening(self) -> list[dict]:
        """The choices of the chunk that opens the stream (none: no such chunk)."""
        return []

    # ---- what both share ----------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def _ranked(self, token_ids: list[int], entries: list[dict], k: int) -> list[tuple[str, float, list]]:
        """(token text, its logprob, the k most likely (token id, logprob)) of each token."""
        return [(self._token(token_id), entry[token_id], sorted(entry.items(), key=lambda item: -item[1])[:k])
                for token_id, entry in zip(token_ids, entries)]

    def usage(self, finals: dict[int, dict]) -> dict:
        prompt_tokens = sum(len(r.prompt_token_ids) for r in self.requests)
        completion_tokens = sum(f["num_tokens"] for f in finals.values())
        cached = sum(finals[i * self.n]["num_cached_tokens"] for i in range(len(self.requests))
                     if i * self.n in finals)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def collect(self) -> dict:
        """Wait for every choice; the whole response."""
        texts: dict[int, list[str]] = {}
        ids: dict[int, list[int]] = {}
        entries: dict[int, list[dict]] = {}
        finals: dict[int, dict] = {}
        async for i, update in updates(self.requests):
            c = i * self.n + update["sample"]
            texts.setdefault(c, []).append(update["text"] or "")
            ids.setdefault(c, []).extend(update["token_ids"])
            if "logprobs" in update:
                entries.setdefault(c, []).extend(update["logprobs"])
            if update["finished"]:
                finals[c] = {"num_tokens": len(ids[c]), "num_cached_tokens": update["num_cached_tokens"],
                             "finish_reason": update["finish_reason"], "stop_reason": update["stop_reason"]}
        choices = [{"index": c, "logprobs": self.logprobs(ids[c], entries.get(c), 0),
                    "finish_reason": finals[c]["finish_reason"], "stop_reason": finals[c]["stop_reason"],
                    **self.content("".join(texts[c]))}
                   for c in sorted(finals)]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(finals)}

    async def stream(self) -> AsyncIterator[dict]:
        """The response as chunks: the opening chunk if any, then text deltas; the last chunk of a
        choice has its finish_reason; usage last when stream_options asks."""
        include_usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        lengths: dict[int, int] = {}  # characters sent per choice (completions' text_offset)
        num_tokens: dict[int, int] = {}
        finals: dict[int, dict] = {}

        def chunk(choices: list[dict]) -> dict:
            out = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                   "choices": choices}
            if include_usage:
                out["usage"] = None
            return out

        if opening := self.opening():
            yield chunk(opening)
        async for i, update in updates(self.requests):
            c = i * self.n + update["sample"]
            text = update["text"] or ""
            num_tokens[c] = num_tokens.get(c, 0) + len(update["token_ids"])
            if not text and not update["finished"] and "logprobs" not in update:
                continue  # (its tokens' text is held back: an unfinished character or stop string)
            logprobs = self.logprobs(update["token_ids"], update.get("logprobs"), lengths.get(c, 0))
            lengths[c] = lengths.get(c, 0) + len(text)
            choice = {"index": c, **self.delta(text), "logprobs": logprobs,
                      "finish_reason": update["finish_reason"] if update["finished"] else None}
            if update["finished"]:
                finals[c] = {"num_tokens": num_tokens[c], "num_cached_tokens": update["num_cached_tokens"]}
                choice["stop_reason"] = update["stop_reason"]
            yield chunk([choice])
        if include_usage:
            yield {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                   "choices": [], "usage": self.usage(finals)}


class CompletionChoices(Choices):
    """/v1/completions: each choice's `text`; logprobs as parallel lists."""
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"
    body: CompletionRequest

    def logprobs(self, token_ids: list[int], entries: list[dict] | None, text_offset: int) -> dict | None:
        if entries is None:
            return None
        ranked = self._ranked(token_ids, entries, self.body.logprobs)
        offsets = []
        for token, _, _ in ranked:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": [token for token, _, _ in ranked], "token_logprobs": [lp for _, lp, _ in ranked],
                "text_offset": offsets, "top_logprobs": [{self._token(i): v for i, v in top} for _, _, top in ranked]}

    def content(self, text: str) -> dict:
        return {"text": text}

    def delta(self, text: str) -> dict:
        return {"text": text}


class ChatChoices(Choices):
    """/v1/chat/completions: each choice's assistant `message`, streamed as deltas after a chunk
    that gives every choice its role; logprobs as a `content` list."""
    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"
    body: ChatCompletionRequest

    def logprobs(self, token_ids: list[int], entries: list[dict] | None, text_offset: int) -> dict | None:
        if entries is None:
            return None
        return {"content": [
            {"token": token, "logprob": lp, "bytes": list(token.encode()),
             "top_logprobs": [{"token": (s := self._token(i)), "logprob": v, "bytes": list(s.encode())}
                              for i, v in top]}
            for token, lp, top in self._ranked(token_ids, entries, self.body.top_logprobs or 0)]}

    def content(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def delta(self, text: str) -> dict:
        return {"delta": {"content": text} if text else {}}

    def opening(self) -> list[dict]:
        return [{"index": c, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for c in range(len(self.requests) * self.n)]


class Server(uvicorn.Server):
    """uvicorn's server in front of one engine, which it tells when a signal asks it to stop."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, banner: str):
        super().__init__(config)
        self.engine, self.banner = engine, banner

    def handle_exit(self, sig, frame):
        """A signal is a request to stop: end every request in flight at once (their streams
        close with finish_reason "abort"), so the graceful shutdown has nothing to wait for,
        and do not re-raise the signal afterwards (uvicorn would, ending us with its status)."""
        super().handle_exit(sig, frame)
        self._captured_signals.clear()
        self.engine.abort_all()

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            print(self.banner, flush=True)


def serve(args) -> int:
    """`nanovllm serve`: load the engine, serve until SIGINT or SIGTERM, then abort what is in
    flight, stop the engine and return 0."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # On CPU, leave a core to the event loop: torch's intra-op threads spin-wait, and fighting
        # them for every core slows the engine several times over.
        torch.set_num_threads(max(1, torch.get_num_threads() - 1))
    llm = llm_from_args(args)
    metrics = None if args.no_metrics else ServingMetrics()
    engine = AsyncEngine(llm, args.max_queued_requests, metrics)
    name = args.served_model_name or args.model
    app = build_app(engine, name, args.api_key, metrics)
    banner = f"nanovllm: serving {name!r} on http://{args.host}:{args.port} (OpenAI API under /v1)"
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   access_log=False, timeout_graceful_shutdown=5), engine, banner)
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0 if server.started else 1
