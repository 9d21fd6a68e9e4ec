"""Data parallelism: `nanovllm serve MODEL --data-parallel-size N` runs N replicas of the whole engine,
each a process of its own (on its own tensor_parallel_size x pipeline_parallel_size GPUs, or a share of
the CPU's threads), behind one front in the server's process.

- The front, DataParallelEngine, is what the server calls (AsyncFront's API): it tokenizes and checks
  each call (a Frontend, no model), picks each prompt's replica (router.py: by prefix, or round robin),
  sends the replica its share of the call, and keeps each replica's sequences in flight (its load).
  One reader thread per replica hands that replica's updates to the calls' event loops.
- A replica (replica_main) is LLM(model, **options) in an AsyncEngine, on an event loop of its own:
  a thread reads the front's commands from a pipe; the loop submits them and sends back, one message
  per pass of the loop (a step's worth), its updates, failures, metric events and stats snapshot.

A replica that dies (its pipe closes) fails its requests in flight with ReplicaFailed (a 503, as
EngineDead is) and is never chosen again; the others go on. The server fails (`error`) once all have.
"""
import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading

import torch

from nanovllm.config import Config
from nanovllm.distributed.router import make_router
from nanovllm.engine.frontend import Frontend
from nanovllm.entrypoints.async_engine import (AsyncEngine, AsyncFront, EngineDead, Request, _call_soon, _put_all,
                                               check_queue_limit)
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The stats that say how things are now (the live replicas' sum); the others are cumulative counts.
NOW = ("num_running", "num_waiting", "kv_cache_usage", "num_host_blocks", "num_host_blocks_used")
STOP_TIMEOUT_S = 30  # a replica told to stop gets this long (its engine's own shutdown) before it is killed
ABORTED = object()  # (what a replica's relay finds in a call's queue for a request aborted there)


class ReplicaFailed(EngineDead):
    """The data-parallel replica running a request died; the other replicas go on."""


# ---- a replica, in its own process ---------------------------------------------------------------
def replica_main(conn, model: str, options: dict, cuda_devices: str | None, num_threads: int | None):
    """A replica's process: its engine, then the front's commands until told to stop (or the front is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the whole process group: the front decides)
    if cuda_devices is not None:  # (before CUDA starts: this replica's GPUs are its cuda:0, cuda:1, ...)
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        llm = LLM(model, **options)
    except BaseException as e:
        conn.send(("failed_to_start", f"{type(e).__name__}: {e}"))
        raise
    asyncio.run(Replica(conn, llm).serve())


class Replica:
    """The replica's side of the pipe; also its AsyncEngine's EngineMetrics, relaying them to the front."""

    def __init__(self, conn, llm):
        self.conn, self.llm = conn, llm
        self.engine = AsyncEngine(llm, metrics=self)
        self.requests: dict[int, Request] = {}  # key (the front's) -> the request, while it runs
        self.aborted: set[int] = set()  # keys aborted before their call was submitted here
        self.calls: set[asyncio.Task] = set()
        self.outbox: list = []  # items for the front, sent together by flush()
        self.lock = threading.Lock()  # (the engine thread posts metric events)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopped: asyncio.Future | None = None

    async def serve(self):
        self.loop, self.stopped = asyncio.get_running_loop(), asyncio.get_running_loop().create_future()
        threading.Thread(target=self.read, name="nanovllm-replica-reader", daemon=True).start()
        config = self.llm.config
        self.conn.send(("ready", {"num_blocks": self.llm.block_manager.num_blocks, "block_size": config.block_size,
                                  "max_num_seqs": config.max_num_seqs}))
        await self.stopped
        self.engine.shutdown()
        self.flush()

    def read(self):
        """The pipe's commands, onto the loop (the front closing the pipe is a stop)."""
        while True:
            try:
                command = self.conn.recv()
            except (EOFError, OSError):
                command = ("stop",)
            self.loop.call_soon_threadsafe(self.handle, command)
            if command[0] == "stop":
                return

    def handle(self, command: tuple):
        match command:
            case ("add", keys, prompt_token_ids, params, stream):
                task = asyncio.ensure_future(self.run_call(keys, prompt_token_ids, params, stream))
                self.calls.add(task)
                task.add_done_callback(self.calls.discard)
            case ("abort", key):
                if key in self.requests:
                    self.abort(self.requests[key])
                else:  # (its call's task has not submitted it yet)
                    self.aborted.add(key)
            case ("close",):
                self.engine.close()
            case ("stop",):
                if not self.stopped.done():
                    self.stopped.set_result(None)

    async def run_call(self, keys: list[int], prompt_token_ids: list[list[int]], params: list[SamplingParams],
                       stream: bool):
        """One call's share: its grammars compiled here too (this engine's cache), then its updates relayed."""
        try:
            for p in params:
                await self.engine.compile_grammar(p)
            requests = self.engine.submit_all(prompt_token_ids, params, stream)
            self.requests.update(zip(keys, requests))
            for key, request in zip(keys, requests):
                if key in self.aborted:
                    self.abort(request)
            await self.relay(keys, requests)
        except Exception as e:
            self.post(*(("error", key, type(e).__name__, str(e)) for key in keys))
            if self.engine.error is not None:  # (the engine is dead: so is this replica, for the front to see)
                self.handle(("stop",))
        finally:
            for key in keys:
                self.requests.pop(key, None)
                self.aborted.discard(key)

    async def relay(self, keys: list[int], requests: list[Request]):
        """The call's updates to the front until each request's samples end, or the request is aborted
        (AsyncEngine sends an aborted request no last update: ABORTED in its queue marks its end here)."""
        left = {id(r): r.params.n for r in requests}
        key_of = {id(r): key for key, r in zip(keys, requests)}
        while any(left.values()):
            request, item = await requests[0].queue.get()
            if isinstance(item, BaseException):
                raise item
            if left[id(request)] == 0:  # (an update that came after its abort)
                continue
            if item is ABORTED:
                left[id(request)] = 0
                continue
            left[id(request)] -= item["finished"]
            self.post(("update", key_of[id(request)], item))

    def abort(self, request: Request):
        self.engine.abort(request)
        request.queue.put_nowait((request, ABORTED))

    def post(self, *items):
        """Queue items for the front (any thread); the first of a batch schedules its flush on the loop."""
        with self.lock:
            first = not self.outbox
            self.outbox.extend(items)
        if first:
            _call_soon(self.loop, self.flush)

    def flush(self):
        with self.lock:
            items, self.outbox = self.outbox, []
        if items:
            self.conn.send(items)

    # EngineMetrics (from the engine thread)
    def request_added(self, num_prompt_tokens: int):
        self.post(("added", num_prompt_tokens))

    def tokens_generated(self, num_tokens: int):
        self.post(("tokens", num_tokens))

    def sequence_finished(self, metrics: dict):
        self.post(("finished", metrics))

    def stepped(self, stats: dict):
        self.post(("stats", stats))


# ---- the front, in the server's process ----------------------------------------------------------
def replica_gpus(size: int, per_replica: int) -> list[str]:
    """Each replica's CUDA_VISIBLE_DEVICES: the next per_replica of the GPUs this process sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(devices) < size * per_replica:
        raise ValueError(f"data_parallel_size={size} replicas of {per_replica} GPU(s) each (tensor_parallel_size x "
                         f"pipeline_parallel_size) need {size * per_replica} GPUs; {len(devices)} are visible")
    return [",".join(devices[i * per_replica:(i + 1) * per_replica]) for i in range(size)]


class ReplicaHandle:
    """The front's view of one replica: its process and pipe, and what runs there."""

    def __init__(self, index: int, process, conn):
        self.index, self.process, self.conn = index, process, conn
        self.alive = True
        self.requests: dict[int, list] = {}  # key -> [its Request, its samples not finished]
        self.load = 0  # sequences in flight here (the router's load)
        self.stats: dict = {}  # its engine's last snapshot (AsyncEngine.stats)
        self.info: dict = {}  # from its ready message: num_blocks, block_size, max_num_seqs
        self.send_lock = threading.Lock()
        self.reader: threading.Thread | None = None  # (the front's thread reading this replica's pipe)

    def send(self, message: tuple) -> bool:
        """Whether the message went (a dead replica's pipe is closed: its reader fails its requests)."""
        try:
            with self.send_lock:
                self.conn.send(message)
            return True
        except (OSError, ValueError):
            return False


class DataParallelEngine(AsyncFront):
    """`size` replicas of LLM(model, **options) behind one front (see the module's docstring); `routing`:
    router.py's "prefix" or "round_robin". max_queued_requests and metrics as AsyncEngine's."""

    def __init__(self, model: str, options: dict, size: int, routing: str = "prefix",
                 max_queued_requests: int | None = None, metrics=None):
        if size < 2:
            raise ValueError(f"data_parallel_size must be >= 2 for DataParallelEngine, got {size}")
        config = Config.from_options(model, options)
        super().__init__(Frontend(config))
        self.max_queued_requests, self.metrics = max_queued_requests, metrics
        self.replica_metrics = None if metrics is None else ReplicaMetrics(metrics.registry)
        self.stats = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        self._lock = threading.Lock()  # the replicas' requests and loads, error (reader threads and the loop)
        self._keys = itertools.count()  # (a request's key on its replica)
        self._where: dict[int, tuple[ReplicaHandle, int]] = {}  # id(request) -> its replica and key, in flight
        self._stopping = False
        self.replicas = self._start(model, options, size, config)
        info = [r.info for r in self.replicas]
        self.router = make_router(routing, size, info[0]["block_size"], [i["num_blocks"] for i in info],
                                  slack=info[0]["max_num_seqs"])
        for replica in self.replicas:
            replica.reader = threading.Thread(target=self._read, args=(replica,), daemon=True,
                                              name=f"nanovllm-dp-reader-{replica.index}")
            replica.reader.start()
        logger.info("Data parallelism: %d replicas (pids %s), routing %s, %d KV blocks each", size,
                    ", ".join(str(r.process.pid) for r in self.replicas), routing, info[0]["num_blocks"])

    @staticmethod
    def _start(model: str, options: dict, size: int, config: Config) -> list[ReplicaHandle]:
        """Spawn the replicas, each on its own GPUs (or a share of the threads), and wait until all are ready."""
        gpus = replica_gpus(size, config.world_size) if config.device == "cuda" else [None] * size
        threads = max(1, torch.get_num_threads() // size) if config.device == "cpu" else None
        context = mp.get_context("spawn")  # (CUDA cannot be used in a forked child)
        replicas = []
        for i in range(size):
            conn, child = context.Pipe()
            process = context.Process(target=replica_main, args=(child, model, options, gpus[i], threads),
                                      name=f"nanovllm-dp-replica-{i}", daemon=False)
            process.start()
            child.close()
            replicas.append(ReplicaHandle(i, process, conn))
        try:
            for replica in replicas:
                try:
                    kind, info = replica.conn.recv()
                except EOFError:
                    replica.process.join(5)
                    kind, info = "failed_to_start", f"it exited with code {replica.process.exitcode}"
                if kind != "ready":
                    raise RuntimeError(f"data-parallel replica {replica.index} failed to start: {info}")
                replica.info = info
        except BaseException:  # (the others may still be loading: no use waiting for them)
            for replica in replicas:
                replica.process.kill()
                replica.process.join()
            raise
        return replicas

    # ---- the asyncio side ---------------------------------------------------------------------
    def submit_all(self, prompt_token_ids: list[list[int]], params: list[SamplingParams],
                   stream: bool = False) -> list[Request]:
        """AsyncEngine.submit_all's contract; each prompt goes to the replica the router picks."""
        for ids, p in zip(prompt_token_ids, params, strict=True):
            self.llm.check_request(len(ids), p)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        requests = [Request(ids, p, stream, queue, loop) for ids, p in zip(prompt_token_ids, params)]
        shares: dict[ReplicaHandle, list[tuple[int, Request]]] = {}
        with self._lock:
            self.check_open()
            check_queue_limit(self.max_queued_requests, sum(p.n for p in params), len(requests),
                              self.stats["num_waiting"])
            for request in requests:
                loads = [r.load if r.alive else None for r in self.replicas]
                replica = self.replicas[self.router.choose(request.prompt_token_ids, loads)]
                key = next(self._keys)
                replica.requests[key] = [request, request.params.n]
                replica.load += request.params.n
                self._where[id(request)] = (replica, key)
                shares.setdefault(replica, []).append((key, request))
                if self.replica_metrics is not None:
                    self.replica_metrics.routed.labels(str(replica.index)).inc()
            self._count_waiting()
        for replica, share in shares.items():
            keys, sent = [k for k, _ in share], [r for _, r in share]
            if not replica.send(("add", keys, [r.prompt_token_ids for r in sent], [r.params for r in sent], stream)):
                self._lost(replica)
        return requests

    def abort(self, request: Request):
        """End the request's unfinished samples, on its replica (any thread; idempotent). As AsyncEngine's
        abort, it sends the request no last update (its reader has gone): it leaves the replica's load now."""
        with self._lock:
            where = self._where.get(id(request))
            if where is not None:
                self._finish_samples(where[0], where[1], where[0].requests[where[1]][1])
                self._count_waiting()
        if where is not None:
            where[0].send(("abort", where[1]))

    def close(self):
        """Refuse later calls and abort those in flight, on every replica."""
        with self._lock:
            self.closing = True
        for replica in self.replicas:
            replica.send(("close",))

    def shutdown(self):
        """Stop every replica (each its engine and workers), then their processes for sure."""
        self._stopping = True
        for replica in self.replicas:
            replica.send(("stop",))
        for replica in self.replicas:
            replica.process.join(STOP_TIMEOUT_S)
            if replica.process.is_alive():
                logger.warning("data-parallel replica %d did not stop in %d s: killed", replica.index, STOP_TIMEOUT_S)
                replica.process.kill()
                replica.process.join()
            replica.reader.join(STOP_TIMEOUT_S)  # (it has read the pipe's end: the process is gone)
            replica.conn.close()
        self._tokenizer.shutdown(wait=False, cancel_futures=True)

    # ---- the reader threads -------------------------------------------------------------------
    def _read(self, replica: ReplicaHandle):
        while True:
            try:
                items = replica.conn.recv()
            except (EOFError, OSError):
                break
            self._dispatch(replica, items)
        self._lost(replica)

    def _dispatch(self, replica: ReplicaHandle, items: list[tuple]):
        """A replica's batch: updates and failures to their calls' loops (one wake-up each), the rest to metrics."""
        outbox: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for item in items:
                match item:
                    case ("update", key, update):
                        entry = replica.requests.get(key)
                        if entry is None:
                            continue
                        if update["finished"]:
                            self._finish_samples(replica, key, 1)
                        outbox.setdefault(entry[0].loop, []).append((entry[0], update))
                    case ("error", key, kind, message):
                        entry = replica.requests.get(key)
                        if entry is not None:
                            self._finish_samples(replica, key, entry[1])
                            error = (ReplicaFailed if kind in ("EngineDead", "ShuttingDown") else RuntimeError)(
                                f"data-parallel replica {replica.index}: {kind}: {message}")
                            outbox.setdefault(entry[0].loop, []).append((entry[0], error))
                    case ("stats", stats):
                        replica.stats = stats
                    case _:
                        self._relay_metric(item)
            self._snapshot()
        for loop, queued in outbox.items():
            _call_soon(loop, _put_all, queued)

    def _finish_samples(self, replica: ReplicaHandle, key: int, count: int):
        entry = replica.requests[key]
        entry[1] -= count
        replica.load -= count
        if entry[1] <= 0:
            del replica.requests[key]
            self._where.pop(id(entry[0]), None)

    def _relay_metric(self, item: tuple):
        if self.metrics is None:
            return
        match item:
            case ("added", num_prompt_tokens):
                self.metrics.request_added(num_prompt_tokens)
            case ("tokens", num_tokens):
                self.metrics.tokens_generated(num_tokens)
            case ("finished", metrics):
                self.metrics.sequence_finished(metrics)

    def _lost(self, replica: ReplicaHandle):
        """The replica's pipe closed: it is dead. Its requests fail; with the last replica, the front does."""
        with self._lock:
            if not replica.alive:
                return
            replica.alive = False
            lost = [entry[0] for entry in replica.requests.values()]
            for request in lost:
                self._where.pop(id(request), None)
            replica.requests.clear()
            replica.load = 0
            if not any(r.alive for r in self.replicas):
                self.error = ReplicaFailed("every data-parallel replica has died")
            self._snapshot()
        if self._stopping:
            return
        replica.process.join(1)
        error = ReplicaFailed(f"data-parallel replica {replica.index} died (exit code {replica.process.exitcode}); "
                              "the other replicas go on")
        logger.error("%s; %d request(s) in flight there failed", error, len(lost))
        for request in lost:
            request.fail(error)

    def _snapshot(self):
        """The replicas' stats as one engine's (sums; KV usage: the live replicas' mean), for the queue
        limit and the metrics. Under self._lock."""
        snapshots = [r.stats for r in self.replicas if r.stats]
        live = [r.stats for r in self.replicas if r.stats and r.alive]
        if not snapshots:
            return
        stats = {}
        for key, value in snapshots[0].items():
            if isinstance(value, list):  # (accepted tokens per draft position)
                width = max(len(s[key]) for s in snapshots)
                stats[key] = [sum(s[key][i] for s in snapshots if i < len(s[key])) for i in range(width)]
            elif key in NOW:
                stats[key] = sum(s[key] for s in live)
            else:  # (cumulative counts: a dead replica's stay in, so that the counters never go back)
                stats[key] = sum(s[key] for s in snapshots)
        stats["kv_cache_usage"] /= max(1, len(live))
        self.stats = stats
        self._count_waiting()
        if self.metrics is not None:
            self.metrics.stepped(self.stats)
            self.replica_metrics.stepped(self.replicas)

    def _count_waiting(self):
        """What waits: sequences sent and not yet running (a replica's snapshot lags what was just sent)."""
        self.stats["num_waiting"] = sum(max(0, r.load - r.stats.get("num_running", 0)) for r in self.replicas
                                        if r.alive)


class ReplicaMetrics:
    """Each replica's own gauges, labelled replica="0", "1", ... (the unlabelled ones are their sums)."""

    def __init__(self, registry):
        from prometheus_client import Counter, Gauge
        self.routed = Counter("nanovllm:replica_requests", "Prompts the router sent to the replica.", ["replica"],
                              registry=registry)
        self.up = Gauge("nanovllm:replica_up", "1 while the data-parallel replica runs, 0 once it has died.",
                        ["replica"], registry=registry)
        self.running = Gauge("nanovllm:replica_num_requests_running", "Sequences in the replica's running batch.",
                             ["replica"], registry=registry)
        self.in_flight = Gauge("nanovllm:replica_num_requests_in_flight", "Sequences sent to the replica and not "
                               "finished (what the router balances).", ["replica"], registry=registry)
        self.kv_usage = Gauge("nanovllm:replica_kv_cache_usage_perc", "The replica's KV cache usage (0 to 1).",
                              ["replica"], registry=registry)
        self.cached = Gauge("nanovllm:replica_prefix_cache_hit_tokens", "Prompt tokens the replica's prefix cache "
                            "served (cumulative).", ["replica"], registry=registry)

    def stepped(self, replicas: list[ReplicaHandle]):
        for r in replicas:
            label = str(r.index)
            self.up.labels(label).set(1 if r.alive else 0)
            self.running.labels(label).set(r.stats.get("num_running", 0) if r.alive else 0)
            self.in_flight.labels(label).set(r.load)
            self.kv_usage.labels(label).set(r.stats.get("kv_cache_usage", 0.0) if r.alive else 0.0)
            self.cached.labels(label).set(r.stats.get("num_cached_tokens", 0))
