"""Tensor and pipeline parallelism over several nodes (nnodes > 1).

world_size = tensor_parallel_size x pipeline_parallel_size ranks, world_size / nnodes on each
node: node k holds ranks k * local .. (k + 1) * local - 1 (with pipeline stages of tp ranks and tp
dividing local, whole stages: TP within a node, PP across nodes). Node 0 runs the engine (rank 0)
and spawns its other local ranks; every other node runs `nanovllm serve MODEL --headless`
(run_headless), which spawns its own ranks and serves nothing. Start-up, all through node 0's
TCPStore at master_addr:master_port:

  1. each headless node reaches the store and announces itself (node/K: the options every node
     must agree on, node_view); node 0 waits for all of them, node_timeout seconds at most;
  2. node 0 compares the views with its own and publishes its verdict, and with an "ok" the
     engine's Config and runner class: the other nodes' ranks run with node 0's options (their
     own flags give only the model folder, whose config.json must be node 0's, and the master);
  3. every rank joins the model's group (distributed/stages.make_group: NCCL on GPU, gloo on CPU) and a gloo control
     group, over which rank 0 broadcasts each call (`NodeWorkers.call`) that workers on one node
     take from a pipe (engine/workers.py).

Any disagreement, a node that does not come, a port in use, ends start-up with a ValueError that
names the option, on node 0 and on the node concerned; rank 0's `close` (or its death: its
connections close) ends every rank, and each node's process exits when its ranks have.
"""
import hashlib
import multiprocessing as mp
import os
import pickle
import signal
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nanovllm.distributed.stages import make_group
from nanovllm.utils.processes import check_alive, died_starting, stop_processes

if TYPE_CHECKING:
    from nanovllm.config import Config

# An idle engine broadcasts nothing for as long as it is idle: the control group never times out
# (rank 0's death closes its connections, which ends every wait at once).
CONTROL_TIMEOUT = timedelta(days=365)
# The options every node must be started with (the others come from node 0): node_view's keys.
AGREED = ("nnodes", "tensor_parallel_size", "pipeline_parallel_size", "model_config")


def node_view(config: "Config") -> dict:
    """What a node was started with, of the options all must agree on (AGREED)."""
    model = hashlib.sha256(config.hf_config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
    return {"nnodes": config.nnodes, "tensor_parallel_size": config.tensor_parallel_size,
            "pipeline_parallel_size": config.pipeline_parallel_size, "model_config": model}


def headless_command(config: "Config", node_rank: int) -> str:
    return (f"nanovllm serve MODEL --headless --tensor-parallel-size {config.tensor_parallel_size} "
            f"--pipeline-parallel-size {config.pipeline_parallel_size} --nnodes {config.nnodes} --node-rank "
            f"{node_rank} --master-addr {config.master_addr} --master-port {config.master_port}")


def local_ranks(config: "Config", node_rank: int) -> range:
    local = config.world_size // config.nnodes
    return range(node_rank * local, (node_rank + 1) * local)


def gpu_index(config: "Config", rank: int) -> int:
    """The GPU a rank takes on its node (cuda:gpu_index; its group's local_rank): its place among
    the node's ranks (local_ranks), not its rank in the world."""
    return rank % (config.world_size // config.nnodes)


def open_store(config: "Config", is_master: bool) -> dist.TCPStore:
    """Node 0's store (is_master), or a connection to it; under torchrun its agent's store, which
    already listens at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE)."""
    timeout = timedelta(seconds=config.node_timeout)
    is_master = is_master and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        return dist.TCPStore(config.master_addr, config.master_port, is_master=is_master, wait_for_workers=False,
                             timeout=timeout)
    except (RuntimeError, OSError) as e:  # (DistNetworkError, DistStoreError: RuntimeErrors)
        if is_master:
            raise ValueError(f"node 0 cannot listen on master_port={config.master_port} ({e}); pass a free port "
                             f"as --master-port / master_port") from None
        raise ValueError(f"node {config.node_rank} could not reach node 0 at master_addr={config.master_addr} "
                         f"master_port={config.master_port} within node_timeout={config.node_timeout} s ({e}); "
                         f"is node 0 started, with these --master-addr / --master-port?") from None


# ---- node 0 --------------------------------------------------------------------------------------
class NodeWorkers:
    """Node 0's side (engine/workers.py's interface: group, call, check_alive, close): the
    store, the other nodes' agreement, its own ranks 1..local-1, and the control group."""

    def __init__(self, config: "Config", runner_class: type):
        if config.node_rank != 0:
            raise ValueError(f"an engine (LLM, or nanovllm serve without --headless) runs on node 0; node_rank="
                             f"{config.node_rank} runs ranks only: {headless_command(config, config.node_rank)} "
                             f"(or nanovllm.distributed.nodes.run_headless)")
        size = config.world_size
        self.processes = []
        self.store = open_store(config, is_master=True)
        self._finalizer = weakref.finalize(self, stop_processes, self.processes, [])
        try:
            self._agree(config)
            self.store.set("engine", pickle.dumps((config, runner_class)))
            self.store.set("verdict", "ok")
            context = mp.get_context("spawn")  # CUDA cannot be used in a forked child
            for rank in local_ranks(config, 0)[1:]:
                p = context.Process(target=rank_main, args=(config, runner_class, rank), daemon=True,
                                    name=f"nanovllm-tp-rank{rank}")
                p.start()
                self.processes.append(p)
            self.group = make_group(dist.PrefixStore("tp", self.store), 0, config)
            self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", self.store), 0, size, CONTROL_TIMEOUT)
        except BaseException as e:
            if not self.store.check(["verdict"]):
                self.store.set("verdict", f"node 0 failed to start: {e}")
            self.close()
            for rank, p in enumerate(self.processes, start=1):
                if p.exitcode not in (None, 0, -15):
                    raise died_starting(rank, p) from e
            raise

    def _agree(self, config: "Config"):
        """Wait for every other node's view (node_timeout), then compare it with this one's."""
        keys = [f"node/{k}" for k in range(1, config.nnodes)]
        try:
            self.store.wait(keys, timedelta(seconds=config.node_timeout))
        except RuntimeError:  # (DistStoreError: timed out)
            missing = [k for k, key in enumerate(keys, start=1) if not self.store.check([key])]
            raise ValueError(f"node(s) {missing} of nnodes={config.nnodes} did not join within node_timeout="
                             f"{config.node_timeout} s; start each with: "
                             f"{headless_command(config, missing[0])}") from None
        mine = node_view(config)
        for k, key in enumerate(keys, start=1):
            theirs = pickle.loads(self.store.get(key))
            for name in AGREED:
                if theirs[name] != mine[name]:
                    what = ("a model whose config.json differs from node 0's" if name == "model_config"
                            else f"{name}={theirs[name]}, node 0 {name}={mine[name]}")
                    message = f"node {k} was started with {what}: every node needs the same {name}"
                    self.store.set("verdict", message)
                    raise ValueError(message)

    def check_alive(self):  # (this node's ranks: another node's death fails the step's collectives)
        check_alive(self.processes)

    def call(self, method, *args) -> int:
        """Every other rank, on every node, runs it (workers.Workers.call's contract)."""
        self.check_alive()
        message = pickle.dumps((method, args), pickle.HIGHEST_PROTOCOL)
        broadcast(self.control, message)
        return len(message)

    def close(self):
        if getattr(self, "control", None) is not None:
            try:
                broadcast(self.control, None)  # every rank's loop ends
            except RuntimeError:  # (a rank already gone)
                pass
            self.control = None
        self._finalizer()
        if getattr(self, "group", None) is not None:
            self.group.shutdown()
            self.group = None


# ---- every node's ranks, and the other nodes ------------------------------------------------------
def rank_main(config: "Config", runner_class: type, rank: int):
    """One rank other than 0, on any node: its runner replays each call rank 0 broadcasts."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (rank 0 decides)
    store = open_store(config, is_master=False)
    size = config.world_size
    group = make_group(dist.PrefixStore("tp", store), rank, config, local_rank=gpu_index(config, rank))
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, size, CONTROL_TIMEOUT)
    runner = runner_class(config, group)
    while (message := receive(control)) is not None:
        method, args = pickle.loads(message)
        method(runner, *args) if callable(method) else getattr(runner, method)(*args)
    group.shutdown()


def run_headless(config: "Config") -> int:
    """Node node_rank > 0: announce it to node 0, take the engine's options from it, run this
    node's ranks until rank 0 ends them. Returns the exit status (0: every rank ended cleanly)."""
    if config.node_rank == 0:
        raise ValueError("--headless is for the other nodes (node_rank >= 1); node 0 runs the engine")
    store = open_store(config, is_master=False)
    if store.add(f"node/{config.node_rank}/claims", 1) > 1:
        raise ValueError(f"node_rank={config.node_rank} is already taken: give each node its own --node-rank")
    store.set(f"node/{config.node_rank}", pickle.dumps(node_view(config)))
    try:
        store.wait(["verdict"], timedelta(seconds=config.node_timeout))
    except RuntimeError:
        raise ValueError(f"node 0 gave no verdict within node_timeout={config.node_timeout} s (are the other "
                         f"nodes started?)") from None
    verdict = store.get("verdict").decode()
    if verdict != "ok":
        raise ValueError(verdict)
    engine_config, runner_class = pickle.loads(store.get("engine"))
    # this node's copy of the model (the same config.json), and node 0's address as this node reaches it
    engine_config.model, engine_config.master_addr = config.model, config.master_addr
    context = mp.get_context("spawn")
    processes = [context.Process(target=rank_main, args=(engine_config, runner_class, rank), daemon=True,
                                 name=f"nanovllm-tp-rank{rank}") for rank in local_ranks(config, config.node_rank)]
    for p in processes:
        p.start()
    try:
        for p in processes:
            p.join()
    finally:
        stop_processes(processes, [])
    return 0 if all(p.exitcode == 0 for p in processes) else 1


# ---- the control group's messages ------------------------------------------------------------------
def broadcast(control, message: bytes | None):
    """Rank 0's message to every rank (None: stop): its length, then its bytes."""
    length = torch.tensor([-1 if message is None else len(message)], dtype=torch.int64)
    control.broadcast([length], dist.BroadcastOptions()).wait()
    if message is not None:
        control.broadcast([torch.frombuffer(bytearray(message), dtype=torch.uint8)], dist.BroadcastOptions()).wait()


def receive(control) -> bytes | None:
    length = torch.zeros(1, dtype=torch.int64)
    control.broadcast([length], dist.BroadcastOptions()).wait()
    if length.item() < 0:
        return None
    data = torch.empty(int(length.item()), dtype=torch.uint8)
    control.broadcast([data], dist.BroadcastOptions()).wait()
    return data.numpy().tobytes()

