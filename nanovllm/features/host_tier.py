"""The prefix cache's second tier: KV blocks in host memory, keyed by the same chained hash.

A cached device block (published, no sequence holding it) that is about to be reused for other
tokens is first copied here (write-back on eviction), so a later request with that prefix reloads
it instead of recomputing it. Slots are evicted least recently used first. HostTier decides where
blocks go; HostCopies copies them, before each step's forward (StepBatch.offloads / .reloads).

A host entry records what its K/V were computed from, as a device block does (block_manager.Block):
its tokens, the id of its contents (uid) and of its parent's (parent_uid). A hit verifies its
tokens and that its parent is the contents the lookup matched before it, so a chain of verified
blocks stands for exactly the prefix's tokens, whatever the hash does.
"""
import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from time import perf_counter

import numpy as np
import torch

from nanovllm.utils.context import to_device

# preemption_mode: "recompute" frees a preempted sequence's blocks (its prefix is computed again,
# or revived from the prefix cache); "swap" keeps them in the host tier (kv_offloading_size).
PREEMPTION_MODES = ("recompute", "swap")


def check_options(config):
    """Check Config's kv_offloading_size (GiB of host memory, all ranks together) and
    preemption_mode, and what each needs (Config calls it when either is not its default)."""
    size = config.kv_offloading_size
    if isinstance(size, bool) or not isinstance(size, (int, float)):
        raise TypeError(f"kv_offloading_size must be a number of GiB (0: no host tier), got {size!r}")
    if not (math.isfinite(size) and size >= 0):
        raise ValueError(f"kv_offloading_size must be a finite number of GiB >= 0 (0: no host tier), got {size}")
    if not isinstance(config.preemption_mode, str) or config.preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {config.preemption_mode!r}")
    if config.preemption_mode == "swap" and not (size > 0 and config.enable_prefix_caching):
        raise ValueError("preemption_mode='swap' keeps preempted sequences' blocks in the host tier: it needs "
                         f"kv_offloading_size > 0 (got {size}) and enable_prefix_caching=True "
                         f"(got {config.enable_prefix_caching})")
    if size > 0 and config.speculative is not None and config.speculative.method == "draft_model":
        # (its cache mirrors the target's blocks: an offloaded block would need its K/V too)
        raise ValueError("kv_offloading_size > 0 is not supported with speculative decoding by a draft model "
                         "(method 'draft_model'); n-gram speculation ('ngram') works with it")


# The copies move through device staging tensors of at most this many bytes at a time (a whole
# 100k-token prefix reloaded at once would otherwise need as much free device memory as its K/V:
# 11 GB for Qwen3-0.6B), so they fit in what the KV sizing leaves beside the cache.
COPY_STAGING_BYTES = 64 << 20


@dataclass
class HostEntry:
    slot: int
    token_ids: list[int]
    uid: int                # the contents' id, kept from the device block it was copied from
    parent_uid: int | None


class HostTier:
    """The host tier as the block manager sees it (block_manager.host): it looks a key up here when
    the device misses (lookup, then use), offers each cached block it is about to hand out for other
    tokens (offload), and queues the copy back of each host hit (reload). A step's copies are queued
    in `offloads` (device block -> host slot), then `reloads` (host slot -> device block: a block may
    be offloaded and reloaded into in one step), and taken with take_copies() for StepBatch. A key
    is then on the device (hash_to_block), here (entries), or both; in flight while its copy is queued."""

    def __init__(self, num_slots: int):
        assert num_slots > 0
        self.num_slots = num_slots
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()  # chained hash -> entry, least recently used first
        self.free_slots = list(range(num_slots - 1, -1, -1))       # (pop() hands out slot 0 first)
        self.pinned: set[int] = set()  # hashes whose slot a reload of the step being planned reads
        self.offloads: list[tuple[int, int]] = []  # (device block, host slot), queued for the next step
        self.reloads: list[tuple[int, int]] = []   # (host slot, device block)

    def offload(self, block):
        """Queue a copy of a cached device block's K/V here (block_manager.Block), unless it is here already."""
        if block.hash in self.entries:
            return
        slot = self.reserve(block.hash, block.token_ids, block.uid, block.parent_uid)
        if slot is not None:
            self.offloads.append((block.block_id, slot))

    def reload(self, entry: HostEntry, block_id: int):
        """Queue the copy of a host hit into the device block given it (pinned by use() already)."""
        self.reloads.append((entry.slot, block_id))

    def take_copies(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The planned step's offloads (device block, host slot) and reloads, [n, 2] int32 each (or None)."""
        offloads = np.array(self.offloads, dtype=np.int32) if self.offloads else None
        reloads = np.array(self.reloads, dtype=np.int32) if self.reloads else None
        self.offloads, self.reloads = [], []
        self.unpin()
        return offloads, reloads

    def lookup(self, h: int, token_ids: list[int], parent_uid: int | None) -> HostEntry | None:
        """The entry of key h if it holds these tokens after this parent (read-only)."""
        entry = self.entries.get(h)
        if entry is None or entry.token_ids != token_ids or entry.parent_uid != parent_uid:
            return None
        return entry

    def use(self, h: int):
        """A reload of h is queued: h is the most recently used, and pinned until the step's copies
        are taken (no offload of the same step may overwrite its slot before the reload reads it)."""
        self.entries.move_to_end(h)
        self.pinned.add(h)

    def reserve(self, h: int, token_ids: list[int], uid: int, parent_uid: int | None) -> int | None:
        """A slot to write the block of key h into (h must not be here), evicting the least
        recently used entry when none is free; None when every entry is pinned by this step."""
        assert h not in self.entries
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((k for k in self.entries if k not in self.pinned), None)
            if victim is None:
                return None
            slot = self.entries.pop(victim).slot
        self.entries[h] = HostEntry(slot, token_ids, uid, parent_uid)
        return slot

    def unpin(self):
        """The step's copies are issued: its reloads read their slots before any later write."""
        self.pinned.clear()

    @property
    def num_used(self) -> int:
        return len(self.entries)


def pinned_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty host tensor in page-locked memory, so that copies between it and the device are
    asynchronous DMA. Registered with cudaHostRegister rather than allocated with pin_memory=True:
    torch's pinned allocator rounds every allocation up to a power of two bytes (a 40 GiB host
    tier would lock 64 GiB). Unregistered when the tensor is freed."""
    t = torch.empty(shape, dtype=dtype)
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0))
    weakref.finalize(t, _unregister_host_memory, t.data_ptr()).atexit = False  # (at exit the process goes anyway)
    return t


def _unregister_host_memory(ptr: int):
    torch.cuda.synchronize()  # (no copy may still be reading or writing it)
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))


def slot_runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(first index, first slot, count) of each run of consecutive host slots in slots [n]: each
    run is one copy. [5, 6, 7, 2] -> [(0, 5, 3), (3, 2, 1)]."""
    breaks = np.flatnonzero(np.diff(slots.astype(np.int64)) != 1) + 1
    firsts, ends = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(slots)]])
    return [(int(a), int(slots[a]), int(b - a)) for a, b in zip(firsts, ends)]


class HostCopies:
    """The host tier's data on one rank, and the copies a step asks for before its forward.

    Host slots of whole KV blocks, laid out per block, [num_blocks, 2 (K/V), layers, block_size,
    Hkv, D], so that a block (or a run of consecutive slots) moves in one copy instead of 2 * layers
    small strided ones; the device side is gathered into the same layout first, one kernel for all
    of a step's blocks. Each rank moves its own shard (of its heads; with pipeline stages, of its
    stage's layers): kv_offloading_size / world_size GiB, the same number of slots on every rank
    (smallest_over_ranks)."""

    def __init__(self, config, kv_cache: torch.Tensor, block_bytes: int, smallest_over_ranks):
        self.kv_cache, self.device = kv_cache, kv_cache.device  # [2, L, num_blocks + 1, bs, Hkv, D]
        self.copy_stream, self.events = None, []
        self.counts = {"offloaded_blocks": 0, "reloaded_blocks": 0, "offloaded_bytes": 0, "reloaded_bytes": 0,
                       "copy_time_s": 0.0}
        # (block_bytes: this rank's shard; no draft model: Config refuses it)
        self.num_blocks = smallest_over_ranks(int(config.kv_offloading_size * 2**30 / config.world_size)
                                              // block_bytes)
        if self.num_blocks < 1:
            raise ValueError(f"kv_offloading_size={config.kv_offloading_size} GiB holds no KV block: one takes "
                             f"{block_bytes * config.world_size} bytes over all ranks; raise it, or 0: off")
        shape = (self.num_blocks, *kv_cache.shape[:2], *kv_cache.shape[3:])
        if self.device.type == "cuda":
            self.cache = pinned_host_tensor(shape, config.kv_dtype)
            self.copy_stream = torch.cuda.Stream(self.device)
        else:
            self.cache = torch.empty(shape, dtype=config.kv_dtype)

    def copy(self, offloads: np.ndarray | None, reloads: np.ndarray | None):
        """A step's copies: offloads [n, 2] (device block, host slot), then reloads [m, 2] (host
        slot, device block). On CUDA they run on a stream of their own, outside any CUDA graph, and
        the host does not wait: the copy stream first waits for the compute stream, where earlier
        steps' forwards (queued, maybe not run yet) write the K/V an offload reads and read the
        blocks a reload overwrites; the compute stream then waits for the copies. On CPU: at once."""
        offloads = offloads if offloads is not None and len(offloads) else None
        reloads = reloads if reloads is not None and len(reloads) else None
        if offloads is None and reloads is None:
            return
        if self.copy_stream is None:
            start = perf_counter()
            self._move_blocks(offloads, reloads)
            self.counts["copy_time_s"] += perf_counter() - start
        else:
            self._collect_copy_times()
            compute = torch.cuda.current_stream(self.device)
            self.copy_stream.wait_stream(compute)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.copy_stream):
                start.record()
                self._move_blocks(offloads, reloads)
                end.record()
            compute.wait_event(end)
            self.events.append((start, end))
        block_bytes = self.cache[0].nbytes
        for name, pairs in (("offloaded", offloads), ("reloaded", reloads)):
            count = len(pairs) if pairs is not None else 0
            self.counts[f"{name}_blocks"] += count
            self.counts[f"{name}_bytes"] += count * block_bytes

    def _move_blocks(self, offloads: np.ndarray | None, reloads: np.ndarray | None):
        """The copies, on the current stream, COPY_STAGING_BYTES at a time. The device tensors made
        here are allocated, used and freed on this one stream, so the caching allocator hands their
        memory only to work queued after them: they need no keeping alive (nor the pinned index
        buffers, which to_device's allocator holds until their copies are done)."""
        blocks = self.kv_cache.permute(2, 0, 1, 3, 4, 5)  # [num_blocks + 1, 2, L, bs, Hkv, D] (a view)
        chunk = max(1, COPY_STAGING_BYTES // self.cache[0].nbytes)  # blocks per staging tensor
        for part in range(0, len(offloads) if offloads is not None else 0, chunk):
            pairs = offloads[part:part + chunk]
            gathered = blocks[to_device(pairs[:, 0].astype(np.int64), self.device)].contiguous()  # [n, 2, L, ...]
            for first, slot, count in slot_runs(pairs[:, 1]):
                self.cache[slot:slot + count].copy_(gathered[first:first + count], non_blocking=True)
        for part in range(0, len(reloads) if reloads is not None else 0, chunk):
            pairs = reloads[part:part + chunk]
            staging = torch.empty((len(pairs), *self.cache.shape[1:]), dtype=self.cache.dtype,
                                  device=self.device)  # [m, 2, L, ...]
            for first, slot, count in slot_runs(pairs[:, 0]):
                staging[first:first + count].copy_(self.cache[slot:slot + count], non_blocking=True)
            blocks[to_device(pairs[:, 1].astype(np.int64), self.device)] = staging

    def stats(self) -> dict:
        """This rank's copies so far (counts); copy_time_s on CUDA: the copy stream's time in the
        copies finished by now, read from its events without waiting for the others."""
        self._collect_copy_times()
        return dict(self.counts)

    def _collect_copy_times(self):
        """Add the device time of the finished copies to copy_time_s (CUDA; no host sync)."""
        pending = []
        for start, end in self.events:
            if end.query():
                self.counts["copy_time_s"] += start.elapsed_time(end) / 1000
            else:
                pending.append((start, end))
        self.events = pending

    def gather(self, block_ids: list[int], slots: list[int]) -> torch.Tensor:
        """(Tests) These device blocks and host slots, [2 (device, host), n, 2, L, bs, Hkv, D]."""
        if self.copy_stream is not None:  # (the host reads the cache: the copies must be done)
            self.copy_stream.synchronize()
        device = self.kv_cache.permute(2, 0, 1, 3, 4, 5)[torch.tensor(block_ids, device=self.device)]
        return torch.stack([device, self.cache[torch.tensor(slots)].to(self.device)])


def gather_blocks(runner, block_ids: list[int], slots: list[int]) -> list[torch.Tensor] | None:
    """(Tests) Each rank's shard of these device blocks and host slots of a ModelRunner's host tier:
    on rank 0 a CPU tensor [2 (device, host), n, 2, L, bs, Hkv, D] per rank (None on the others,
    which rank 0 has run it on through its workers)."""
    if runner.workers is not None:
        runner.workers.call(gather_blocks, block_ids, slots)
    both = runner.host_copies.gather(block_ids, slots)
    parts = runner.group.gather(both) if runner.group is not None else [both]
    return [p.cpu() for p in parts] if parts is not None else None
