"""Tensor-parallel groups, one per engine.

Each engine owns its process group, on its own store (no global default group), so two engines
can live in one process. Layers read the model's group from `tensor_parallel(group)` when built.
"""
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective waiting longer than this means a peer died mid-step: fail instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


class TPGroup:
    def __init__(self, store: dist.Store, rank: int, size: int, device: str):
        self.rank, self.size = rank, size
        if device == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT  # without it NCCL waits ~10 minutes for a dead peer
            self.pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.pg.allreduce([t], options).wait()
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` on rank 0 (None elsewhere)."""
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else []
        self.pg.gather([parts] if self.rank == 0 else [], [t], options).wait()
        return parts if self.rank == 0 else None

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (on CUDA the wait is the stream's, not the host's)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([t], options).wait()
        return t

    def shutdown(self):
        if hasattr(self.pg, "shutdown"):
            self.pg.shutdown()


_GROUP: TPGroup | None = None


@contextmanager
def tensor_parallel(group: TPGroup | None):
    """Layers built inside see `group` through tp_rank() / tp_size() / tp_group()."""
    global _GROUP
    previous, _GROUP = _GROUP, group
    try:
        yield
    finally:
        _GROUP = previous


def tp_group() -> TPGroup | None:
    return _GROUP


def tp_rank() -> int:
    return _GROUP.rank if _GROUP is not None else 0


def tp_size() -> int:
    return _GROUP.size if _GROUP is not None else 1
