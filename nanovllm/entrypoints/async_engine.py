"""The engine behind an asyncio front: one thread owns the engine and steps it; any number of
coroutines submit requests and read their results, and the event loop never waits for a step.

Everything that touches the engine (tokenizing, validating, queueing, aborting, stepping) runs on
the engine thread, so the engine itself stays single-threaded. Coroutines talk to it through a
thread-safe command queue; results flow back to each request's own asyncio queue.
"""
import asyncio
import dataclasses
import logging
import threading
from queue import Empty, SimpleQueue
from collections.abc import AsyncIterator
from typing import Protocol

from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm")


class EngineMetrics(Protocol):
    """What the engine thread reports as it goes (entrypoints/metrics.py keeps Prometheus metrics)."""
    def request_added(self, num_prompt_tokens: int): ...
    def tokens_generated(self, num_tokens: int): ...
    def sequence_finished(self, seq: Sequence): ...
    def stepped(self, stats: dict): ...


class QueueFull(Exception):
    """max_queued_requests requests are already waiting: try again later."""


class EngineDead(Exception):
    """The engine thread failed (for example a tensor-parallel worker died); nothing more can run."""


@dataclasses.dataclass(eq=False)
class Request:
    """One submitted request: a prompt (a string, token ids, or chat messages to render with the
    tokenizer's chat template) and its sampling parameters (fill_context: its max_tokens is what
    the prompt leaves of max_model_len). Its updates arrive in `queue` as (request, update) pairs:
    several requests of one API call may share a queue."""
    prompt: str | list[int] | list[dict]
    params: SamplingParams
    fill_context: bool
    stream: bool
    queue: asyncio.Queue
    accepted: asyncio.Future  # done once the engine thread has validated and queued it
    samples: list[Sequence] = dataclasses.field(default_factory=list)  # the engine thread's
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)

    def fail(self, error: BaseException):
        """From the engine thread: the engine failed; the reader gets the error. (Updates go
        through AsyncEngine._flush, a step's worth at a time.)"""
        self._call(self.queue.put_nowait, (self, error))

    def settle(self, error: BaseException | None = None):
        """From the engine thread: the request is queued (or refused with error)."""
        self._call(_settle, self.accepted, error)

    def _call(self, function, *args):
        _call_soon(self.accepted.get_loop(), function, *args)


def _call_soon(loop: asyncio.AbstractEventLoop, function, *args):
    """Run function(*args) on loop's thread, from any thread."""
    try:
        loop.call_soon_threadsafe(function, *args)
    except RuntimeError:  # the event loop is closed: nobody is reading any more
        pass


def _put_all(items: list[tuple[Request, dict]]):
    for request, update in items:
        request.queue.put_nowait((request, update))


def _settle(future: asyncio.Future, error: BaseException | None):
    if not future.done():  # (cancelled when the client went away first)
        future.set_exception(error) if error is not None else future.set_result(None)


# The commands the asyncio side sends the engine thread (through AsyncEngine._commands).
@dataclasses.dataclass
class Add:
    """Validate and queue a request (its `accepted` future says how that went)."""
    request: Request


@dataclasses.dataclass
class Abort:
    """End a request's unfinished samples."""
    request: Request


@dataclasses.dataclass
class AbortAll:
    """End every request in flight, each with its last update."""


@dataclasses.dataclass
class Stop:
    """Abort everything and end the engine thread."""


Command = Add | Abort | AbortAll | Stop


async def updates(requests: list[Request]) -> AsyncIterator[tuple[int, dict]]:
    """(i, update) for the updates of requests[i] (LLMEngine.stream_update's dicts), as they come,
    until every sample of every request has finished. The requests share one queue. A failure of
    the engine is raised here."""
    index = {id(request): i for i, request in enumerate(requests)}
    left = sum(request.params.n for request in requests)
    queue = requests[0].queue
    while left:
        request, item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        left -= item["finished"]
        yield index[id(request)], item


class AsyncEngine:
    """Runs `llm` on a thread of its own. `submit()` queues a request and waits until it is
    validated; `updates()` yields its results; `abort()` ends it (a client that went
    away). `stats` is a snapshot of the engine's queues and KV usage, refreshed every step."""

    def __init__(self, llm: LLMEngine, max_queued_requests: int | None = None, metrics: EngineMetrics | None = None):
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1 or None, got {max_queued_requests}")
        self.llm = llm
        self.max_queued_requests = max_queued_requests
        self.metrics = metrics
        self.error: BaseException | None = None
        self._commands: SimpleQueue[Command] = SimpleQueue()
        self._num_submitted = 0  # Add commands not yet taken by the engine thread
        self._lock = threading.Lock()
        self._by_seq: dict[int, Request] = {}  # seq_id -> its request (engine thread only)
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # updates of this step, per event loop
        self.stats = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        self._thread = threading.Thread(target=self._loop, name="nanovllm-engine", daemon=True)
        self._thread.start()

    # ---- the asyncio side ---------------------------------------------------------------------
    async def submit(self, prompt, params: SamplingParams, stream: bool = False,
                     fill_context: bool = False) -> Request:
        """Queue a request and wait until the engine thread has validated it; its updates then
        arrive in its queue (see `updates()`). stream: updates as tokens come (else one per
        sample, at its end). fill_context: generate up to max_model_len instead of
        params.max_tokens (chat's default when a request sets no limit). Raises the engine's
        ValueError/TypeError for a bad request, QueueFull when max_queued_requests requests are
        waiting already, EngineDead when the engine has failed."""
        return (await self.submit_all([prompt], params, stream, fill_context))[0]

    async def submit_all(self, prompts: list, params: SamplingParams, stream: bool = False,
                         fill_context: bool = False) -> list[Request]:
        """submit() for several prompts sharing one queue (the prompts of one API call): queued
        together, so the engine takes them in one go; all of them or none (a refused one aborts
        the others)."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        requests = [Request(prompt, params, fill_context, stream, queue, loop.create_future()) for prompt in prompts]
        with self._lock:  # (the engine thread sets error, and drains the commands, under it)
            if self.error is not None:
                raise EngineDead(f"the engine has failed: {self.error!r}")
            if (self.max_queued_requests is not None
                    and self._num_submitted + self.stats["num_waiting"] + len(requests) > self.max_queued_requests):
                raise QueueFull(f"{self.max_queued_requests} requests are already waiting (--max-queued-requests)")
            self._num_submitted += len(requests)
            for request in requests:
                self._commands.put(Add(request))
        try:
            results = await asyncio.gather(*(request.accepted for request in requests), return_exceptions=True)
        except asyncio.CancelledError:  # the client went away before the engine answered
            results = [asyncio.CancelledError()]
        refusals = [e for e in results if isinstance(e, BaseException)]
        if refusals:
            for request in requests:
                self.abort(request)
            raise refusals[0]
        return requests

    def abort(self, request: Request):
        """End the request's unfinished samples and free their blocks (any thread; idempotent)."""
        self._commands.put(Abort(request))

    def abort_all(self):
        """End every request in flight: each one's samples finish with finish_reason "abort"."""
        self._commands.put(AbortAll())

    def shutdown(self):
        """Abort everything, stop the engine thread and the engine (its worker processes)."""
        self._commands.put(Stop())
        self._thread.join()
        self.llm.shutdown()

    # ---- the engine thread --------------------------------------------------------------------
    def _loop(self):
        llm = self.llm
        try:
            while True:
                command = self._commands.get() if llm.is_finished() else self._next_command()
                handled = command is not None
                while command is not None:
                    if isinstance(command, Stop):
                        self._abort_all()
                        self._flush()
                        self._refuse_the_rest(RuntimeError("the engine has been shut down"))
                        return
                    self._handle(command)
                    command = self._next_command()
                if handled:
                    self._snapshot()  # (the queue limit counts what was just queued)
                if not llm.is_finished():
                    self._deliver(llm.step())
                self._flush()
                self._snapshot()
        except BaseException as e:  # nothing can run any more: tell everyone waiting
            logger.exception("the engine failed; every request in flight fails with it")
            unfinished = [*self._by_seq.values(), *(r for items in self._outbox.values() for r, _ in items)]
            for request in {id(r): r for r in unfinished}.values():
                request.fail(EngineDead(f"the engine has failed: {e!r}"))
            self._by_seq.clear()
            self._outbox.clear()
            self._refuse_the_rest(e)

    def _refuse_the_rest(self, error: BaseException):
        """The thread is ending: refuse every request submitted and not yet taken, and any later one."""
        with self._lock:
            self.error = error
            while (command := self._next_command()) is not None:
                if isinstance(command, Add):
                    command.request.settle(EngineDead(f"the engine has failed: {error!r}"))

    def _next_command(self) -> Command | None:
        try:
            return self._commands.get_nowait()
        except Empty:
            return None

    def _handle(self, command: Add | Abort | AbortAll):
        match command:
            case Add(request):
                with self._lock:
                    self._num_submitted -= 1
                try:
                    self._add(request)
                except (ValueError, TypeError) as e:  # a bad request
                    request.settle(e)
                except Exception as e:  # a request that trips a bug: it fails, the others go on
                    logger.exception("a request could not be queued")
                    request.settle(e)
            case Abort(request):
                self._abort(request)
            case AbortAll():
                self._abort_all()

    def _add(self, request: Request):
        llm, prompt = self.llm, request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):  # chat messages
            prompt = llm.render_chat(prompt)
        ids = llm.encode_prompt(prompt)
        params = request.params
        if request.fill_context:  # what the prompt leaves of the context
            params = dataclasses.replace(params, max_tokens=max(1, llm.config.max_model_len - len(ids)))
        request.samples = llm.add_request(ids, params, stream=request.stream)
        request.prompt_token_ids = ids
        for seq in request.samples:
            self._by_seq[seq.seq_id] = request
        if self.metrics is not None:
            self.metrics.request_added(len(ids))
        request.settle()

    def _abort(self, request: Request):
        for seq in request.samples:
            if self._by_seq.pop(seq.seq_id, None) is not None:
                self.llm.abort(seq)

    def _abort_all(self):
        """Abort every request and send each one's samples their last update."""
        for request in {id(r): r for r in self._by_seq.values()}.values():
            for seq in request.samples:
                if seq.seq_id in self._by_seq:
                    self.llm.abort(seq)
                    self._send(request, seq)

    def _deliver(self, updated: list[Sequence]):
        for seq in updated:
            request = self._by_seq.get(seq.seq_id)
            if request is not None and (request.stream or seq.is_finished):
                self._send(request, seq)

    def _send(self, request: Request, seq: Sequence):
        update = self.llm.stream_update(seq)
        if update is None:
            return
        if self.metrics is not None:
            self.metrics.tokens_generated(len(update["token_ids"]))
        if update["finished"]:
            del self._by_seq[seq.seq_id]
            if self.metrics is not None:
                self.metrics.sequence_finished(seq)
        self._outbox.setdefault(request.accepted.get_loop(), []).append((request, update))

    def _flush(self):
        """Hand this step's updates over: one wake-up of each event loop, not one per update."""
        for loop, items in self._outbox.items():
            _call_soon(loop, _put_all, items)
        self._outbox = {}

    def _snapshot(self):
        llm = self.llm
        stats = llm.stats()
        self.stats = {"num_running": stats["num_running"], "num_waiting": stats["num_waiting"],
                      "kv_cache_usage": (stats["num_blocks"] - stats["num_free_blocks"]) / stats["num_blocks"],
                      "num_cached_tokens": stats["num_cached_tokens"], "num_preemptions": stats["num_preemptions"]}
        if self.metrics is not None:
            self.metrics.stepped(self.stats)
