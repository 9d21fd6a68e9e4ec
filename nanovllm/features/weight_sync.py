"""Weights from a trainer over torch.distributed (issue 50: the engine as an RL rollout worker).

The trainer is rank 0 of a group of its own with the engine's ranks (rank_offset.. : one per
tensor-parallel rank), and broadcasts each updated tensor in turn; every engine rank receives it
and loads its shard, as update_weights does (features/weight_updates.py).

    # the trainer's process (rank 0)
    group = WeightUpdateGroup("127.0.0.1", port, rank=0, world_size=1 + tensor_parallel_size)
    # the engine's process, at the same time (both sides wait for each other to join)
    llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=1 + tensor_parallel_size)
    # each update: the engine asks for the tensors by name, dtype and shape, the trainer sends them in that order
    llm.update_weights_from_distributed(names, dtypes, shapes)     # (the engine's side)
    for name in names: group.broadcast(trainer_state[name])        # (the trainer's, at the same time)

WeightUpdateGroup is two lines of plain PyTorch, which a trainer may write itself: a TCPStore the
trainer hosts (is_master=True) and a ProcessGroupGloo (CPU tensors) or ProcessGroupNCCL (CUDA
tensors) on it, without the store prefixes of torch.distributed.init_process_group, so the group
is neither side's default group and the trainer's own training group is untouched. gloo on CPU,
NCCL on GPU; a peer that never joins (or never sends) is an error after timeout_s.

The engine checks the names and shapes before it receives anything (a ValueError then, and the
trainer's broadcast waits until its own timeout); an error while receiving (the trainer died)
leaves the tensors received so far loaded, and says so.
"""
import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.features.idle_engine import on_every_rank, reset_prefix_cache
from nanovllm.features.weight_updates import _load_plan, _plan, begin_update, load_param_check
from nanovllm.utils.tp_group import TPGroup

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


class WeightUpdateGroup(TPGroup):
    """A torch.distributed group of the trainer (rank 0) and the engine's ranks, on a TCPStore of the
    trainer's; broadcast() (TPGroup's) sends rank 0's tensor to all, shutdown() ends it."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 backend: str = "gloo", timeout_s: float = 60.0):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.size, self.local_rank, self.backend = rank, world_size, rank, backend
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)


def init_weight_update_group(llm, master_address: str, master_port: int, rank_offset: int, world_size: int,
                             backend: str | None = None, timeout_s: float = 60.0):
    """Every engine rank joins the trainer's group as rank rank_offset + its tensor-parallel rank."""
    config = llm.config
    backend = backend or ("nccl" if config.device == "cuda" else "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "nccl" and config.device != "cuda":
        raise ValueError("backend='nccl' needs the engine on CUDA; use 'gloo' on CPU")
    for name, value in (("master_port", master_port), ("rank_offset", rank_offset), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if rank_offset < 1 or rank_offset + config.world_size > world_size:
        raise ValueError(f"the engine's {config.world_size} ranks from rank_offset={rank_offset} do not fit in "
                         f"world_size={world_size} after the trainer's rank 0")
    if config.pipeline_parallel_size > 1:
        raise ValueError("init_weight_update_group is not supported yet with pipeline parallelism")
    if getattr(llm.model_runner, "weight_update_group", None) is not None:
        raise ValueError("this engine is in a weight update group already")
    on_every_rank(llm, join_group, master_address, master_port, rank_offset, world_size, backend, timeout_s)
    if llm.model_runner.weight_update_group is None:
        raise RuntimeError(f"the trainer's group at {master_address}:{master_port} could not be joined within "
                           f"{timeout_s} s (is the trainer, rank 0, creating it with world_size={world_size}?)")


def join_group(runner, master_address, master_port, rank_offset, world_size, backend, timeout_s):
    """A rank's part: join as rank_offset + its rank (an error is logged, not raised: a worker must live on)."""
    runner.weight_update_group = None
    try:
        runner.weight_update_group = WeightUpdateGroup(master_address, master_port, rank_offset + runner.rank,
                                                       world_size, backend, timeout_s)
    except Exception as e:  # (DistNetworkError, DistStoreError, a timeout: whatever the store raises)
        logger.error("rank %d: joining the weight update group failed: %s", runner.rank, e)


def update_weights_from_distributed(llm, names: list[str], dtypes: list, shapes: list) -> int:
    """Receive the trainer's broadcast of each tensor (names[i], dtypes[i], shapes[i], in that order)
    on every rank into the weights; then reset the prefix cache. Returns the parameter loads."""
    if getattr(llm.model_runner, "weight_update_group", None) is None:
        raise ValueError("no weight update group: call init_weight_update_group first")
    if not (isinstance(names, (list, tuple)) and isinstance(dtypes, (list, tuple)) and isinstance(shapes, (list, tuple))
            and len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names, dtypes and shapes must be lists of one length")
    specs = [(name, as_dtype(dtype), tuple(shape)) for name, dtype, shape in zip(names, dtypes, shapes)]
    begin_update(llm, "update_weights_from_distributed")
    # (checked before anything is received: empty host tensors of those shapes, into scratch copies)
    load_param_check(llm.model_runner.model, [(n, torch.empty(s, dtype=d)) for n, d, s in specs],
                     "update_weights_from_distributed")
    on_every_rank(llm, receive_weights, specs)
    runner = llm.model_runner
    if runner.weight_update_error is not None:
        raise RuntimeError(f"update_weights_from_distributed: {runner.weight_update_error} (the tensors before it "
                           f"are loaded, the rest are not)")
    reset_prefix_cache(llm)
    return runner.weight_update_loads


def receive_weights(runner, specs: list[tuple[str, torch.dtype, tuple]]):
    """A rank's part: each tensor received from the trainer, then loaded into its shard (an error is
    kept in runner.weight_update_error, not raised: a worker must live on)."""
    group = runner.weight_update_group
    device = runner.device if group.backend == "nccl" else torch.device("cpu")
    runner.weight_update_error, runner.weight_update_loads = None, 0
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        try:
            group.broadcast(tensor)
        except Exception as e:  # (the trainer died, or sent nothing within the timeout)
            runner.weight_update_error = f"receiving {name!r} failed: {e}"
            logger.error("rank %d: %s", runner.rank, runner.weight_update_error)
            return
        plan = _plan(runner.model, [(name, tensor)])
        _load_plan(runner.model, plan)
        runner.weight_update_loads += len(plan)


def as_dtype(dtype) -> torch.dtype:
    """A torch dtype, or its name ("bfloat16", "torch.bfloat16")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtypes must be torch dtypes or their names, got {dtype!r}")
    return found
