"""A tensor-parallel group: one per engine, on the engine's own store (no global default group),
so two engines can live in one process. Built by engine/workers.py, for tensor_parallel_size > 1;
the layers see it through utils/parallel.py's tensor_parallel(group)."""
from datetime import timedelta

import torch
import torch.distributed as dist

# A collective waiting longer than this means a peer died mid-step: fail instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


class TPGroup:
    """rank: in the group; local_rank: on its node (its GPU's index; None: rank, one node).
    (distributed/stages.py's StageGroup also makes groups of every rank of every stage of it.)"""
    def __init__(self, store: dist.Store, rank: int, size: int, device: str, local_rank: int | None = None):
        self.rank, self.size = rank, size
        self.local_rank = rank if local_rank is None else local_rank
        if device == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT  # without it NCCL waits ~10 minutes for a dead peer
            self.pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)

    @property
    def tp(self) -> "TPGroup":
        """The group the model's layers shard over: this one (a pipeline stage's StageGroup has its own)."""
        return self

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
