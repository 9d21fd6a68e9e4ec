"""Ranks 1..N-1 (tensor_parallel_size x pipeline_parallel_size in all): spawned processes that
replay rank 0's calls step by step.

The engine (rank 0's process) creates a `Workers` (start_workers; over several nodes,
distributed/nodes.py's NodeWorkers instead) and hands it to its ModelRunner. It creates
the engine's own rendezvous store on a free port, spawns one process per extra rank and sends
each a pickled `(method, args)` per call over a pipe. The workers run the same ModelRunner method, so the collectives inside the model
(all-reduce, gather) line up. Workers ignore Ctrl-C (rank 0 decides), and exit when told to,
when their pipe closes (rank 0 died), or are terminated on close.
(Config's check that the model splits over the ranks is distributed/options.py's.)
"""
import multiprocessing as mp
import pickle
import signal
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from nanovllm.distributed.stages import make_group
from nanovllm.utils.processes import JOIN_TIMEOUT_S, check_alive, died_starting, stop_processes

if TYPE_CHECKING:
    from nanovllm.config import Config

STORE_TIMEOUT = timedelta(seconds=120)  # rendezvous: long enough for a worker to import torch


def _worker_main(config: "Config", runner_class: type, rank: int, store_port: int, conn):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = dist.TCPStore("127.0.0.1", store_port, config.world_size, is_master=False, timeout=STORE_TIMEOUT)
    conn.send("started")
    group = make_group(store, rank, config)
    runner = runner_class(config, group)
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # rank 0 is gone
            break
        if message is None:
            break
        method, args = message  # a ModelRunner method's name, or a function of the runner
        method(runner, *args) if callable(method) else getattr(runner, method)(*args)
    group.shutdown()


def start_workers(config: "Config", runner_class: type):
    """Ranks 1.. of the engine: spawned here (Workers), or over several nodes (distributed/nodes.py)."""
    if config.nnodes > 1:
        from nanovllm.distributed.nodes import NodeWorkers  # (multi-node's layer: loaded when asked for)
        return NodeWorkers(config, runner_class)
    return Workers(config, runner_class)


class Workers:
    def __init__(self, config: "Config", runner_class: type):
        size = config.world_size
        # Port 0: the OS picks a free port; each engine has its own store, so engines never collide.
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                   timeout=STORE_TIMEOUT)
        context = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self.processes, self.conns = [], []
        for rank in range(1, size):
            parent, child = context.Pipe()
            p = context.Process(target=_worker_main, args=(config, runner_class, rank, self.store.port, child),
                                name=f"nanovllm-tp-rank{rank}", daemon=True)
            p.start()
            child.close()
            self.processes.append(p)
            self.conns.append(parent)
        # Runs at close(), at garbage collection of this object and at interpreter exit.
        self._finalizer = weakref.finalize(self, stop_processes, self.processes, self.conns)
        try:
            self._wait_started()
            self.group = make_group(self.store, 0, config)
        except BaseException:
            self.close()
            raise

    def _wait_started(self):
        """Wait for every worker to reach the store, failing fast if one dies on the way (for
        example a script without an `if __name__ == "__main__":` guard, which spawn re-runs)."""
        for rank, (p, conn) in enumerate(zip(self.processes, self.conns), start=1):
            while not conn.poll(0.1):
                if not p.is_alive():
                    raise died_starting(rank, p)
            try:
                message = conn.recv()
            except (EOFError, OSError):  # its end of the pipe closed: it died (poll() saw the EOF first)
                p.join(JOIN_TIMEOUT_S)
                raise died_starting(rank, p) from None
            assert message == "started"

    def check_alive(self):
        check_alive(self.processes)

    def call(self, method, *args) -> int:
        """Have every worker run `ModelRunner.<method>(*args)` (method: its name), or `method(runner,
        *args)` (a module-level function); rank 0 then runs it itself.
        The call is pickled once for all workers; returns its size in bytes."""
        self.check_alive()
        message = pickle.dumps((method, args), pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(message)
        return len(message)

    def close(self):
        self._finalizer()
        if getattr(self, "group", None) is not None:
            self.group.shutdown()
            self.group = None
