"""Prefill/decode disaggregation: a prefill engine and a decode engine, each a process of its own (on its
own GPU where there are two), behind a front in the caller's process (DisaggregatedLLM).

A request goes to the prefill engine first. It computes the prompt (within a batch of its own), copies
the K/V of the prompt's full blocks out of its cache and keeps them, under the request's key, until they
are pulled. The front then hands the request to the decode engine, whose puller thread asks the prefill
engine for those blocks by the key and receives them over torch.distributed (send/recv in a group of the
two processes: gloo on CPU, NCCL between GPUs) while the decode engine goes on stepping its running
sequences. Between two steps the decode engine writes the blocks into free blocks of its own cache and
publishes them in its prefix cache under the prompt's chained hashes, as the block manager does for the
blocks it computes, then queues the request: its prefix is a cache hit, so it computes only the tokens
after the last full block (at least the last one, whose logits it samples) and decodes. The K/V are the
same computation as a colocated engine's, so is the output.

Limits: one rank per engine (tensor_parallel_size = pipeline_parallel_size = 1), prefix caching on in
both, a request that finds no room for its blocks in the decode cache computes its prompt there
instead; the front is a Python API (generate, submit), not yet the server.
"""
import itertools
import multiprocessing as mp
import os
import queue
import signal
import threading
from concurrent.futures import Future
from datetime import timedelta
from time import perf_counter

import torch
import torch.distributed as dist

from nanovllm.distributed.router import block_hashes
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams


PREFILL, DECODE = 0, 1  # the two ranks of the transfer group
GROUP_TIMEOUT = timedelta(seconds=120)
STOP = -1  # a pulled key that ends the prefill engine's block server


# ---- both engines' processes ----------------------------------------------------------------------
def start_engine(conn, model: str, options: dict, cuda_device: str | None, rank: int, store_port: int,
                 backend: str):
    """The engine of one side, and its end of the transfer group: (llm, group)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the front decides when to stop)
    if cuda_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_device
    try:
        llm = LLM(model, **options)
        check_engine(llm)
        store = dist.TCPStore("127.0.0.1", store_port, 3, is_master=False, timeout=GROUP_TIMEOUT)
        if backend == "nccl":
            group = dist.ProcessGroupNCCL(dist.PrefixStore("kv", store), rank, 2)
        else:
            group = dist.ProcessGroupGloo(dist.PrefixStore("kv", store), rank, 2, GROUP_TIMEOUT)
    except BaseException as e:
        conn.send(("failed_to_start", f"{type(e).__name__}: {e}"))
        raise
    conn.send(("ready", {"block_size": llm.config.block_size, "max_model_len": llm.config.max_model_len}))
    return llm, group


def receive(conn):
    """The front's next command; None (stop) also when the front is gone."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def check_engine(llm):
    c = llm.config
    if c.world_size != 1:
        raise ValueError("disaggregated prefill/decode runs engines of one rank each (tensor_parallel_size = "
                         f"pipeline_parallel_size = 1), got world_size={c.world_size}")
    if not c.enable_prefix_caching:
        raise ValueError("disaggregated prefill/decode needs enable_prefix_caching=True in both engines: the "
                         "decode engine serves a pulled prefix from its prefix cache")


def transfer_device(llm, backend: str) -> torch.device:
    """Where a transfer's K/V sit: on the GPU for NCCL, else in host memory (gloo)."""
    return llm.model_runner.kv_cache.device if backend == "nccl" else torch.device("cpu")


def kv_of(llm, block_ids: list[int], device: torch.device) -> torch.Tensor:
    """A copy of these blocks' K/V, [2, layers, blocks, block_size, kv_heads, head_dim] (the cache's layout)."""
    cache = llm.model_runner.kv_cache
    return cache[:, :, torch.tensor(block_ids, device=cache.device)].to(device).contiguous()


def prefill_main(conn, model: str, options: dict, cuda_device: str | None, store_port: int, backend: str):
    """The prefill engine: batches of prompts computed, their full blocks' K/V kept until pulled."""
    llm, group = start_engine(conn, model, options, cuda_device, PREFILL, store_port, backend)
    device = transfer_device(llm, backend)
    staged: dict[int, torch.Tensor] = {}  # key -> its prompt's blocks, until pulled
    lock = threading.Lock()
    server = threading.Thread(target=serve_blocks, args=(group, staged, lock), daemon=True)
    server.start()
    block_size, cached = llm.config.block_size, llm.block_manager
    while True:
        batch = [receive(conn)]
        while batch[-1] is not None and conn.poll():
            batch.append(receive(conn))
        stop = batch[-1] is None
        batch = [command for command in batch if command is not None]
        if not batch:
            break
        try:
            llm.generate([ids for _, ids in batch], SamplingParams(max_tokens=1), use_tqdm=False)
        except (ValueError, TypeError):  # (a bad prompt: the decode engine computes the batch's prompts itself,
            # and refuses that one, saying why)
            batch = [(key, []) for key, _ in batch]
        for key, ids in batch:  # (nothing ran since: the prompts' blocks are all still in the cache)
            found = []
            for i, h in enumerate(block_hashes(ids, block_size)):
                block_id = cached.hash_to_block.get(h)
                if block_id is None or cached.blocks[block_id].token_ids != ids[i * block_size:(i + 1) * block_size]:
                    break  # (evicted by a later prompt of the batch, or a collision: the rest is computed there)
                found.append(block_id)
            if found:
                with lock:
                    staged[key] = kv_of(llm, found, device)
            conn.send(("prefilled", key, len(found)))
        if stop:
            break
    server.join(GROUP_TIMEOUT.total_seconds())  # (it ends at the decode engine's STOP, unless that engine died)
    llm.shutdown()


def serve_blocks(group, staged: dict, lock: threading.Lock):
    """The prefill side of a pull: a key from the decode engine, then that request's blocks to it."""
    key = torch.zeros(1, dtype=torch.int64)
    while True:
        group.recv([key], DECODE, 0).wait()
        if key.item() == STOP:
            return
        with lock:
            blocks = staged.pop(key.item())
        group.send([blocks], DECODE, 1).wait()


def decode_main(conn, model: str, options: dict, cuda_device: str | None, store_port: int, backend: str):
    """The decode engine: each request's pulled blocks published in its prefix cache, then the request run."""
    llm, group = start_engine(conn, model, options, cuda_device, DECODE, store_port, backend)
    DecodeEngine(conn, llm, group, transfer_device(llm, backend)).run()
    llm.shutdown()


class DecodeEngine:
    """The decode side's threads: the pipe's reader, the puller (transfers) and the loop (steps)."""

    def __init__(self, conn, llm, group, device: torch.device):
        self.conn, self.llm, self.group, self.device = conn, llm, group, device
        self.pulls: queue.SimpleQueue = queue.SimpleQueue()  # (key, ids, params, num_blocks) to pull
        self.arrived: queue.SimpleQueue = queue.SimpleQueue()  # (key, ids, params, K/V or None), or None: stop
        self.running: dict[int, tuple[int, list]] = {}  # a sample's seq_id -> (key, the request's samples)
        self.num_steps_during_pulls = 0  # steps this engine ran while a pull was under way (the overlap)
        self.pulling = threading.Event()

    def run(self):
        threading.Thread(target=self.read, daemon=True).start()
        puller = threading.Thread(target=self.pull, daemon=True)
        puller.start()
        stopping = False
        while not (stopping and not self.running):
            if self.llm.is_finished():  # idle: wait for a request
                stopping |= self.admit(self.arrived.get())
            while not self.arrived.empty():
                stopping |= self.admit(self.arrived.get())
            if not self.llm.is_finished():
                self.step()
        puller.join()

    def read(self):
        while True:
            command = receive(self.conn)
            if command is None:
                self.pulls.put(None)  # (after the pulls already asked for)
                return
            key, ids, params, num_blocks = command
            if num_blocks:
                self.pulls.put(command)
            else:
                self.arrived.put((key, ids, params, None))

    def pull(self):
        """Each request's blocks from the prefill engine, in the order asked (a transfer runs beside the steps)."""
        cache = self.llm.model_runner.kv_cache
        shape = list(cache.shape)
        while (command := self.pulls.get()) is not None:
            key, ids, params, num_blocks = command
            self.pulling.set()
            self.group.send([torch.tensor([key])], PREFILL, 0).wait()
            blocks = torch.empty(shape[:2] + [num_blocks] + shape[3:], dtype=cache.dtype, device=self.device)
            self.group.recv([blocks], PREFILL, 1).wait()
            self.pulling.clear()
            self.arrived.put((key, ids, params, blocks))
        self.group.send([torch.tensor([STOP])], PREFILL, 0).wait()  # (ends the prefill engine's block server)
        self.arrived.put(None)

    def admit(self, arrived) -> bool:
        """Queue an arrived request, its pulled blocks published first; True for the stop mark."""
        if arrived is None:
            return True
        key, ids, params, blocks = arrived
        if blocks is not None:
            publish_blocks(self.llm, ids, blocks)
        try:
            samples = self.llm.add_request(ids, params)
        except (ValueError, TypeError) as e:
            self.conn.send(("failed", key, type(e).__name__, str(e)))
            return False
        for seq in samples:
            self.running[seq.seq_id] = (key, samples)
        return False

    def step(self):
        during_pull = self.pulling.is_set()
        updated = self.llm.step()
        self.num_steps_during_pulls += during_pull
        for seq in updated:
            key, samples = self.running.get(seq.seq_id, (None, None))
            if samples is not None and all(s.is_finished for s in samples):  # (the request's last sample)
                for sample in samples:
                    del self.running[sample.seq_id]
                output = self.llm.outputs.output(samples)
                self.conn.send(("done", key, output, samples[0].metrics(), self.num_steps_during_pulls))


def publish_blocks(llm, token_ids: list[int], blocks: torch.Tensor):
    """Write pulled K/V into free blocks and publish them as cached (free, revivable) blocks of
    token_ids' prefix: the block manager's own steps for a block it computed (a fresh contents id, the
    parent's id, the chained hash), for one computed by the prefill engine. A block already cached here
    is kept; too few free blocks: the rest is left to compute."""
    manager, cache = llm.block_manager, llm.model_runner.kv_cache
    block_size = manager.block_size
    parent_uid, taken = None, []
    for i, h in enumerate(block_hashes(token_ids, block_size)[:blocks.shape[2]]):
        tokens = token_ids[i * block_size:(i + 1) * block_size]
        known = manager.hash_to_block.get(h)
        if known is not None and manager.blocks[known].token_ids == tokens and manager.blocks[known].parent_uid == parent_uid:
            parent_uid = manager.blocks[known].uid
            continue
        if not manager.free:
            break
        block_id = manager._take_free_block()  # (held while written: nothing else can take it)
        cache[:, :, block_id] = blocks[:, :, i]
        uid, manager.next_uid = manager.next_uid, manager.next_uid + 1
        manager._publish(manager.blocks[block_id], h, tokens, uid, parent_uid)
        taken.append(block_id)
        parent_uid = uid
    for block_id in reversed(taken):  # (freed as free_blocks frees: the tail first, reused first)
        manager.blocks[block_id].ref_count = 0
        manager.release(block_id)


# ---- the front, in the caller's process -----------------------------------------------------------
class DisaggregatedLLM:
    """A prefill engine and a decode engine (see the module's docstring), both LLM(model, **options)
    with each side's own options on top (prefill_options, decode_options). generate() as LLM's, for
    prompts of token ids; submit() one request: a Future of its output, whose `metrics` are from the
    submit (perf_counter times; `ttft_s`: submit to first token). The engines pull and decode in the
    background; close() (or `with`) stops them once what they hold has finished."""

    def __init__(self, model: str, options: dict | None = None, prefill_options: dict | None = None,
                 decode_options: dict | None = None):
        options = options or {}
        self.store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, timeout=GROUP_TIMEOUT, wait_for_workers=False)
        gpus, backend = [None, None], "gloo"
        if options.get("device", "cuda" if torch.cuda.is_available() else "cpu") == "cuda":
            if torch.cuda.device_count() > 1:  # a GPU each, and NCCL between them
                gpus, backend = ["0", "1"], "nccl"
            else:  # (NCCL takes one GPU a rank: on one, the K/V go through host memory)
                gpus = ["0", "0"]
        context = mp.get_context("spawn")
        self.processes, self.conns = [], []
        for main, extra, gpu in ((prefill_main, prefill_options, gpus[0]), (decode_main, decode_options, gpus[1])):
            conn, child = context.Pipe()
            process = context.Process(target=main, args=(child, model, {**options, **(extra or {})}, gpu,
                                                         self.store.port, backend))
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(conn)
        limits = []
        for side, conn in zip(("prefill", "decode"), self.conns):
            try:
                kind, info = conn.recv()
            except EOFError:
                kind, info = "failed_to_start", "it exited"
            if kind != "ready":
                self._kill()
                raise RuntimeError(f"the {side} engine failed to start: {info}")
            limits.append(info)
        if limits[0]["block_size"] != limits[1]["block_size"]:
            self._kill()
            raise ValueError(f"the prefill and decode engines' block_size differ: {limits[0]['block_size']} and "
                             f"{limits[1]['block_size']}")
        self.block_size = limits[0]["block_size"]
        self.max_model_len = min(limit["max_model_len"] for limit in limits)
        self._keys = itertools.count()
        self._pending: dict[int, tuple[list[int], SamplingParams, Future, float]] = {}
        self._lock = threading.Lock()
        self.num_steps_during_pulls = 0  # the decode engine's steps that ran while a transfer was under way
        for reader in (self._read_prefill, self._read_decode):
            threading.Thread(target=reader, daemon=True).start()

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> Future:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not (isinstance(prompt_token_ids, list) and prompt_token_ids
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids)):
            raise TypeError("a disaggregated prompt is a non-empty list of token ids")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens with max_tokens={params.max_tokens} exceeds "
                             f"max_model_len={self.max_model_len}")
        future, key = Future(), next(self._keys)
        with self._lock:
            self._pending[key] = (prompt_token_ids, params, future, perf_counter())
        if (len(prompt_token_ids) - 1) // self.block_size:
            self.conns[PREFILL].send((key, prompt_token_ids))
        else:  # (no full block to compute elsewhere)
            self.conns[DECODE].send((key, prompt_token_ids, params, 0))
        return future

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
        futures = [self.submit(p, params) for p in prompts]
        return [f.result() for f in futures]

    def _read_prefill(self):
        while True:
            try:
                _, key, num_blocks = self.conns[PREFILL].recv()  # ("prefilled", ...)
            except (EOFError, OSError):
                return self._fail_all("the prefill engine has stopped")
            with self._lock:
                ids, params, _, _ = self._pending[key]
            self.conns[DECODE].send((key, ids, params, num_blocks))

    def _read_decode(self):
        while True:
            try:
                kind, key, *message = self.conns[DECODE].recv()
            except (EOFError, OSError):
                return self._fail_all("the decode engine has stopped")
            with self._lock:
                _, _, future, submitted = self._pending.pop(key)
            if kind == "failed":
                error, text = message
                future.set_exception((TypeError if error == "TypeError" else ValueError)(text))
                continue
            output, metrics, self.num_steps_during_pulls = message
            ttft = metrics["first_token_time"] - submitted if metrics["first_token_time"] is not None else None
            future.set_result({**output, "metrics": {**metrics, "arrival_time": submitted, "ttft_s": ttft}})

    def _fail_all(self, why: str):
        with self._lock:
            pending, self._pending = self._pending, {}
        for _, _, future, _ in pending.values():
            if not future.done():
                future.set_exception(RuntimeError(why))

    def close(self):
        """Stop both engines (each first finishes what it holds), then their processes for sure."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for process in self.processes:
            process.join(60)
        self._kill()

    def _kill(self):
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
