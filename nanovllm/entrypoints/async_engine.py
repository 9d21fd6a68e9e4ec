"""The engine behind an asyncio front: one thread owns the engine and steps it; any number of
coroutines submit requests and read their results, and the event loop never waits for a step.

Three threads share the work, and none waits for another's slow part:
- the event loop parses requests, answers them, and streams their results;
- TOKENIZER_THREADS threads render chat templates and tokenize prompts (`encode`): a 10 MB prompt takes
  seconds there, holding up no step, stream or other prompt (tokenizers releases the GIL as it works);
- the engine thread takes commands from a thread-safe queue, steps the engine (single-threaded), and
  sends each call's asyncio queue its results, a step's worth at a time.

Admission is fair across calls: the engine thread holds a call's requests and hands them to the engine
one call at a time in turn (round robin), keeping at most max_num_seqs sequences waiting in the engine
(first come, first served there), so one call of 100 prompts x n=128 cannot push every later call back.

Operations on the engine itself (an RL trainer's: new weights, a reset prefix cache, sleep and wake-up)
run on the engine thread too, in turn with the calls (see Operation): a weight update pauses admission,
lets the requests in the engine finish on the old weights, runs while the engine is idle, and admits the
calls that waited, so no call ever sees two versions of the weights. Sleep lets every call queued finish
first, and the front refuses new ones (Asleep) from the moment it is asked until the engine is awake.
"""
import asyncio
import dataclasses
import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from queue import Empty, SimpleQueue
from collections.abc import AsyncIterator, Callable
from typing import Literal, Protocol

from nanovllm.engine.frontend import Frontend
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.sequence import Sequence
from nanovllm.entrypoints.media import ImageURLs
from nanovllm.features.structured_outputs import COMPILE_TIMEOUT_S, POLL_S, overdue
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TOKENIZER_THREADS = 4  # (a tokenizer is safe to share: encoding changes none of its settings)


class EngineMetrics(Protocol):
    """What the engine thread reports as it goes (entrypoints/metrics.py keeps Prometheus metrics)."""
    def request_added(self, num_prompt_tokens: int): ...
    def tokens_generated(self, num_tokens: int): ...
    def sequence_finished(self, metrics: dict): ...  # (Sequence.metrics(): picklable, for a replica's)
    def stepped(self, stats: dict): ...


class QueueFull(Exception):
    """max_queued_requests sequences are already waiting: try again later."""


class TooLarge(ValueError):
    """A call of more sequences than max_queued_requests: it could never be queued."""


class ShuttingDown(Exception):
    """The server is stopping: new requests are refused and those in flight are aborted."""


class EngineDead(Exception):
    """The engine thread failed (for example a tensor-parallel worker died); nothing more can run."""


class Asleep(Exception):
    """The engine sleeps (or is going to): no request runs until it is woken up; try again later."""


class Unsupported(Exception):
    """This engine cannot run that operation (data-parallel replicas take no weight updates or sleep)."""


@dataclasses.dataclass
class ChatPrompt:
    """Chat messages and the tools offered with them, to render with the chat template (and template_kwargs)."""
    messages: list[dict]
    tools: list[dict] | None = None
    template_kwargs: dict | None = None


@dataclasses.dataclass(eq=False)
class Request:
    """One prompt of a call, checked, with its parameters; its updates come as (request, update) in the call's queue."""
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    samples: list[Sequence] = dataclasses.field(default_factory=list)  # the engine thread's, once added

    def fail(self, error: BaseException):
        """From the engine thread: the reader gets the error (updates go through AsyncEngine._flush)."""
        _call_soon(self.loop, self.queue.put_nowait, (self, error))


def _call_soon(loop: asyncio.AbstractEventLoop, function, *args):
    """Run function(*args) on loop's thread, from any thread."""
    try:
        loop.call_soon_threadsafe(function, *args)
    except RuntimeError:  # the event loop is closed: nobody is reading any more
        pass


def _fail(future: Future, error: BaseException):
    """An operation's future fails with error (unless its caller gave up waiting: cancelled)."""
    if future.set_running_or_notify_cancel():
        future.set_exception(error)


def _put_all(items: list[tuple[Request, dict]]):
    for request, update in items:
        request.queue.put_nowait((request, update))


# The commands the asyncio side sends the engine thread (through AsyncEngine._commands).
@dataclasses.dataclass
class Add:
    """Queue the requests of one call (checked already: the engine thread only holds and adds them)."""
    requests: list[Request]


@dataclasses.dataclass
class Abort:
    """End a request's unfinished samples (held, or in the engine)."""
    request: Request


@dataclasses.dataclass
class AbortAll:
    """End every request in flight, each with its last update."""


@dataclasses.dataclass
class Stop:
    """Abort everything and end the engine thread."""


# When an Operation's turn comes (the operations run one at a time, in the order they were asked for):
PAUSE = "pause"      # no call not yet begun goes into the engine; once the engine is idle, it runs
DRAIN = "drain"      # every call queued goes in and finishes first (the front refuses new ones meanwhile)
AT_ONCE = "at once"  # now (wake_up: an engine asleep runs nothing, so it is idle already)
Turn = Literal["pause", "drain", "at once"]


@dataclasses.dataclass
class Operation:
    """Run function(llm) on the engine thread when its turn comes, its result or exception to `future`.
    PAUSE is what keeps a call from seeing two versions of the weights: a call runs entirely before a
    weight update or entirely after it (one whose requests went partly into the engine goes in whole first)."""
    function: Callable
    turn: Turn
    future: Future


Command = Add | Abort | AbortAll | Stop | Operation


class HeldCall(deque):
    """The requests of one call not in the engine yet, in order; `started`: some of the call's are."""
    started = False


async def updates(requests: list[Request]) -> AsyncIterator[tuple[int, dict]]:
    """(i, update) for requests[i]'s updates (stream_update's dicts) until every sample ends; raises engine failures."""
    index = {id(request): i for i, request in enumerate(requests)}
    left = sum(request.params.n for request in requests)
    queue = requests[0].queue
    while left:
        request, item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        left -= item["finished"]
        yield index[id(request)], item


def check_queue_limit(limit: int | None, num_seqs: int, num_prompts: int, num_waiting: int):
    """TooLarge or QueueFull for a call of num_seqs sequences while num_waiting wait (limit: --max-queued-requests)."""
    if limit is not None and num_seqs > limit:
        raise TooLarge(f"this call asks for {num_seqs} sequences ({num_prompts} prompt(s) x n), more than "
                       f"the {limit} that --max-queued-requests lets wait: it could never be queued")
    if limit is not None and num_waiting + num_seqs > limit:
        raise QueueFull(f"{limit} sequences may wait (--max-queued-requests), and {num_waiting} are waiting already")


class AsyncFront:
    """What the server calls besides submitting and aborting, on the asyncio side of any engine (this
    module's AsyncEngine, or distributed/data_parallel.py's replicas): `llm` is the Frontend (the
    tokenizer, the checks of requests, the grammar compiler); `error` is set once nothing can run."""

    def __init__(self, llm: Frontend):
        self.llm = llm
        self.error: BaseException | None = None
        self.closing = False  # close() was called: new calls are refused
        self.asleep = 0  # the engine's sleep level (0: awake), as its last operation left it
        self.grammar_timeout_s = COMPILE_TIMEOUT_S  # (a request's own compile; see grammar_job)
        self.image_urls = ImageURLs()  # how image_url parts are read (the server's --allowed-media-domains, ...)
        self._tokenizer = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="nanovllm-tokenizer")

    async def encode(self, prompt) -> list[int]:
        """A prompt (a string, token ids, or a ChatPrompt) as checked token ids, on a tokenizer thread; a
        ValueError/TypeError names what is wrong."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer, self._encode, prompt)

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, ChatPrompt):  # (token ids, or a dict prompt with the images its parts hold)
            from nanovllm.features.chat_template import chat_prompt
            prompt = chat_prompt(self.llm, prompt.messages, prompt.tools, prompt.template_kwargs, self.image_urls.load)
        return self.llm.encode_prompt(prompt)

    async def submit(self, prompt, params: SamplingParams, stream: bool = False) -> Request:
        """encode() and the subclass's submit_all() for one prompt."""
        return self.submit_all([await self.encode(prompt)], [params], stream)[0]

    async def compile_grammar(self, params: SamplingParams):
        """Compile params' structured_outputs on a grammar thread, for the engine to find in its cache: a
        ValueError names a constraint that does not compile, takes too long, or has no allowed first token."""
        if params.structured_outputs is not None:
            job = self.llm.grammar_compiler().submit(params.structured_outputs)
            compiled = await self.grammar_job(job, f"structured_outputs.{params.structured_outputs.kind}: compiling it")
            self.llm.grammars.check_first_token(params, compiled)

    async def grammar_job(self, job: Future, what: str):
        """A grammar thread's job, awaited: a ValueError ("{what} took over ...") once its run (not its wait
        in the queue) passes grammar_timeout_s; ShuttingDown after close(). Cancelled, it drops a job not started."""
        waiter = asyncio.wrap_future(job)
        try:
            while True:
                done, _ = await asyncio.wait({waiter}, timeout=POLL_S)
                if done:
                    return waiter.result()
                self.check_open()
                if overdue(job, self.grammar_timeout_s):
                    raise ValueError(f"{what} took over {self.grammar_timeout_s:g} s; simplify it")
        finally:
            waiter.cancel()  # (and with it the job, if no thread has taken it up)

    def check_open(self):
        """Raise EngineDead or ShuttingDown if no new call can be taken."""
        if self.error is not None:
            raise EngineDead(f"the engine has failed: {self.error!r}")
        if self.closing:
            raise ShuttingDown("the server is shutting down")

    def check_awake(self):
        """Raise Asleep while the engine sleeps, or a sleep it was asked for waits for its turn."""
        if self.asleep:
            raise Asleep(f"the engine is asleep (sleep level {self.asleep}): no request runs until it is woken up")

    # ---- operations on the engine (an RL trainer's), each run alone on the engine thread ----------
    async def update_weights_from_disk(self, model_path: str) -> int:
        """Load a checkpoint folder's weights (LLM.update_weights_from_disk) between calls: those in the engine
        finish on the old weights, those that come meanwhile wait and run on the new. Returns the tensors
        loaded; a ValueError/TypeError (nothing changed) for a bad folder or tensor."""
        return await self.operate(lambda llm: llm.update_weights_from_disk(model_path), PAUSE)

    async def reset_prefix_cache(self):
        """Forget every cached prefix, between calls (as update_weights_from_disk)."""
        await self.operate(lambda llm: llm.reset_prefix_cache(), PAUSE)

    async def sleep(self, level: int):
        """Free the KV cache (level 2: the weights too) once every call queued has finished; calls are
        refused (Asleep) from now until wake_up. A ValueError for a bad level or an engine asleep already."""
        await self.operate(lambda llm: llm.sleep(level), DRAIN)

    async def wake_up(self, tags: list[str] | None):
        """Bring back what sleep freed (tags: "weights", "kv_cache"; None: both); a no-op awake."""
        await self.operate(lambda llm: llm.wake_up(tags), AT_ONCE)

    async def operate(self, function: Callable, turn: Turn):
        """function(llm)'s result, run on the engine thread when `turn` says (see Operation)."""
        raise Unsupported(f"{type(self).__name__} runs no operations on its engine (weight updates, sleep, "
                          "prefix cache reset): serve one replica for them")


class AsyncEngine(AsyncFront):
    """Runs `llm` on a thread of its own; `stats`: the engine's queues and KV usage, refreshed every step.
    max_queued_requests caps the sequences waiting (each prompt counts n times), held ones included."""

    def __init__(self, llm: LLMEngine, max_queued_requests: int | None = None, metrics: EngineMetrics | None = None):
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1 or None, got {max_queued_requests}")
        super().__init__(llm)
        self.max_queued_requests, self.metrics = max_queued_requests, metrics
        self._commands: SimpleQueue[Command] = SimpleQueue()
        self._num_submitted = 0  # sequences in Add commands not yet taken by the engine thread
        self._lock = threading.Lock()
        # the engine thread's:
        self._held: deque[HeldCall] = deque()  # calls with requests not in the engine yet, in turn
        self._num_held = 0  # the sequences they will run
        self._operations: deque[Operation] = deque()  # operations waiting for their turn, in order
        self._draining = 0  # DRAIN operations asked for and not yet run (under _lock: the front refuses calls)
        self._by_seq: dict[int, Request] = {}  # seq_id -> its request
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # updates of this step, per event loop
        self.stats = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        self._thread = threading.Thread(target=self._loop, name="nanovllm-engine", daemon=True)
        self._thread.start()

    # ---- the asyncio side ---------------------------------------------------------------------
    def submit_all(self, prompt_token_ids: list[list[int]], params: list[SamplingParams],
                   stream: bool = False) -> list[Request]:
        """Check and queue the prompts of one call (token ids, from encode()), all or none; read their
        updates with `updates()`. stream: updates as tokens come (else one per sample, at its end). Raises
        the engine's ValueError/TypeError for a bad request, or TooLarge, QueueFull, ShuttingDown, EngineDead."""
        for ids, p in zip(prompt_token_ids, params, strict=True):
            self.llm.check_request(len(ids), p)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        requests = [Request(ids, p, stream, queue, loop) for ids, p in zip(prompt_token_ids, params)]
        num_seqs = sum(p.n for p in params)
        with self._lock:  # (the engine thread sets error, and drains the commands, under it)
            self.check_open()
            self.check_awake()
            check_queue_limit(self.max_queued_requests, num_seqs, len(requests),
                              self._num_submitted + self.stats["num_waiting"])
            self._num_submitted += num_seqs
            self._commands.put(Add(requests))
        return requests

    def abort(self, request: Request):
        """End the request's unfinished samples and free their blocks (any thread; idempotent)."""
        self._commands.put(Abort(request))

    def abort_all(self):
        """End every request in flight: each one's samples finish with finish_reason "abort"."""
        self._commands.put(AbortAll())

    def close(self):
        """Refuse later calls and abort those in flight (any thread; locked: a call is queued first, or refused)."""
        with self._lock:
            self.closing = True
            self._commands.put(AbortAll())

    def check_awake(self):
        """Raise Asleep also while a sleep waits for its turn (calls queued before it run first)."""
        if self._draining and not self.asleep:  # (a call queued now would run into the sleep)
            raise Asleep("the engine is going to sleep: no request runs until it is woken up")
        super().check_awake()

    async def operate(self, function: Callable, turn: Turn):
        """function(llm)'s result, run on the engine thread when `turn` says (Operation); ShuttingDown or
        EngineDead if the engine thread takes no more. Cancelled before its turn, it does not run."""
        future = Future()
        with self._lock:  # (a call is queued before a sleep, and drained; or after it, and refused)
            self.check_open()
            self._draining += turn == DRAIN
            self._commands.put(Operation(function, turn, future))
        return await asyncio.wrap_future(future)

    def shutdown(self):
        """Abort everything, stop the engine thread and the engine (its worker processes)."""
        self._commands.put(Stop())
        self._thread.join()
        self._tokenizer.shutdown(wait=False, cancel_futures=True)
        self.llm.shutdown()

    # ---- the engine thread --------------------------------------------------------------------
    def _loop(self):
        llm = self.llm
        try:
            while True:
                changed = self._run_operations()
                idle = llm.is_finished() and not self._admissible()
                command = self._commands.get() if idle and not changed else self._next_command()
                changed = changed or command is not None
                while command is not None:
                    if isinstance(command, Stop):
                        self._abort_all()
                        self._flush()
                        self._fail_operations(ShuttingDown("the server is shutting down"))
                        self._refuse_the_rest(RuntimeError("the engine has been shut down"))
                        return
                    self._handle(command)
                    command = self._next_command()
                if self._feed() or changed:
                    self._snapshot()  # (the queue limit counts what was just queued)
                if not llm.is_finished():
                    self._deliver(llm.step())
                self._flush()
                self._snapshot()
        except BaseException as e:  # nothing can run any more: tell everyone waiting
            logger.exception("the engine failed; every request in flight fails with it")
            with self._lock:  # first: a client that sees its request fail and calls again is refused
                self.error = e  # by that call (check_open), not queued behind the failure
            unfinished = [*self._by_seq.values(), *(r for call in self._held for r in call),
                          *(r for items in self._outbox.values() for r, _ in items)]
            for request in {id(r): r for r in unfinished}.values():
                request.fail(EngineDead(f"the engine has failed: {e!r}"))
            self._by_seq.clear()
            self._held.clear()
            self._outbox.clear()
            self._fail_operations(EngineDead(f"the engine has failed: {e!r}"))
            self._refuse_the_rest(e)

    def _refuse_the_rest(self, error: BaseException):
        """The thread is ending: fail every call submitted and not yet taken, and refuse any later one."""
        with self._lock:
            self.error = error
            while (command := self._next_command()) is not None:
                if isinstance(command, Add):
                    for request in command.requests:
                        request.fail(EngineDead(f"the engine has failed: {error!r}"))
                elif isinstance(command, Operation):
                    _fail(command.future, EngineDead(f"the engine has failed: {error!r}"))

    def _next_command(self) -> Command | None:
        try:
            return self._commands.get_nowait()
        except Empty:
            return None

    def _handle(self, command: Add | Abort | AbortAll | Operation):
        match command:
            case Add(requests):
                with self._lock:
                    self._num_submitted -= sum(r.params.n for r in requests)
                self._held.append(HeldCall(requests))
                self._num_held += sum(r.params.n for r in requests)
            case Abort(request):
                self._abort(request)
            case AbortAll():
                self._abort_all()
            case Operation():
                self._operations.append(command)

    def _paused(self) -> bool:
        """Whether calls not yet begun wait: the next operation's turn is PAUSE."""
        return bool(self._operations) and self._operations[0].turn == PAUSE

    def _admissible(self) -> bool:
        """Whether a held request may go into the engine now."""
        return any(call.started for call in self._held) if self._paused() else bool(self._held)

    def _feed(self):
        """Hand held requests to the engine, calls in turn, while fewer than max_num_seqs wait in it: as many
        as a step could admit, so it never runs short and a later call waits behind at most that many.
        Paused (an operation waits for the engine to be idle), only calls already begun go on."""
        room = self.llm.config.max_num_seqs - self.llm.stats()["num_waiting"]
        fed, paused = False, self._paused()
        waiting = []  # calls not begun, while paused: back in line after the others
        while self._held and room > 0:
            call = self._held.popleft()
            if paused and not call.started:
                waiting.append(call)
                continue
            request = call.popleft()
            call.started = True
            self._add(request)
            room -= request.params.n  # (its samples wait in the engine now: the first, and its forks)
            fed = True
            if call:
                self._held.append(call)
        self._held.extend(waiting)
        return fed

    def _run_operations(self) -> bool:
        """Run the operations whose turn has come, in order; whether any ran."""
        ran = False
        while self._operations and self._turn_came(self._operations[0]):
            operation = self._operations.popleft()
            future, result, error = operation.future, None, None
            running = future.set_running_or_notify_cancel()  # (False: its caller gave up waiting)
            if running:
                try:
                    result = operation.function(self.llm)
                except (ValueError, TypeError) as e:  # (refused before anything changed: the calls go on)
                    error = e
                except Exception as e:  # (weights half loaded, a worker gone: serving on could mix versions)
                    with self._lock:  # (first, as _loop's: a caller told of it who calls again is refused)
                        self.error = e
                    future.set_exception(EngineDead(f"the engine has failed: {e!r}"))
                    raise  # (to _loop: every call in flight fails)
            with self._lock:  # (the front's word on whether calls are taken, before its caller hears: check_awake)
                self._draining -= operation.turn == DRAIN
                self.asleep = self.llm.asleep
            if running and error is not None:
                future.set_exception(error)
            elif running:
                future.set_result(result)
            ran = True
        return ran

    def _turn_came(self, operation: Operation) -> bool:
        if operation.turn == AT_ONCE:
            return True
        held = self._held if operation.turn == DRAIN else [call for call in self._held if call.started]
        return self.llm.is_finished() and not held

    def _fail_operations(self, error: BaseException):
        """The engine thread is ending: every operation waiting fails with error."""
        while self._operations:
            _fail(self._operations.popleft().future, error)

    def _add(self, request: Request):
        self._num_held -= request.params.n
        try:
            request.samples = self.llm.add_request(request.prompt_token_ids, request.params, stream=request.stream)
        except Exception as e:  # checked already, so a bug: this request fails, the others go on
            logger.exception("a request could not be queued")
            request.fail(e)
            return
        for seq in request.samples:
            self._by_seq[seq.seq_id] = request
        if self.metrics is not None:
            self.metrics.request_added(len(request.prompt_token_ids))

    def _unhold(self, request: Request) -> bool:
        """Take a held request out of its call's turn; whether it was held."""
        for call in self._held:
            if request in call:
                call.remove(request)
                self._num_held -= request.params.n
                if not call:
                    self._held.remove(call)
                return True
        return False

    def _abort(self, request: Request):
        if self._unhold(request):
            return  # (nobody reads it: its client went away)
        for seq in request.samples:
            if self._by_seq.pop(seq.seq_id, None) is not None:
                self.llm.abort(seq)

    def _abort_all(self):
        """Abort every request, sending each sample its last update (a held one is added first, to end alike)."""
        while self._held:
            for request in self._held.popleft():
                self._add(request)
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
                self.metrics.sequence_finished(seq.metrics())
        self._outbox.setdefault(request.loop, []).append((request, update))

    def _flush(self):
        """Hand this step's updates over: one wake-up of each event loop, not one per update."""
        for loop, items in self._outbox.items():
            _call_soon(loop, _put_all, items)
        self._outbox = {}

    def _snapshot(self):
        stats = self.llm.stats()
        self.stats = {"num_running": stats["num_running"], "num_waiting": stats["num_waiting"] + self._num_held,
                      "kv_cache_usage": (stats["num_blocks"] - stats["num_free_blocks"]) / stats["num_blocks"],
                      **{key: stats[key] for key in ("num_cached_tokens", "num_preemptions", "spec_num_drafts",
                                                     "spec_num_draft_tokens", "spec_num_accepted_tokens",
                                                     "spec_num_accepted_tokens_per_pos", "prefix_cache_queries",
                                                     "host_cache_queries", "host_cache_hits", "kv_offloaded_bytes",
                                                     "kv_reloaded_bytes", "kv_copy_time_s", "num_host_blocks",
                                                     "num_host_blocks_used")}}
        if self.metrics is not None:
            self.metrics.stepped(self.stats)
