"""Sleep and wake (issue 50: the engine as an RL rollout worker, which gives its memory to the
trainer between rollouts).

    llm.sleep(level=1)   # the KV cache freed; the weights copied to host memory (on CPU they are there)
    llm.sleep(level=2)   # ... and the weights dropped: the trainer sends new ones anyway
    llm.wake_up()        # both back (or tags=["weights"] first, to update them before the KV cache returns)

A request while asleep is a RuntimeError at once (LLMEngine.check_awake). The KV computed before the
sleep is gone, so the prefix cache forgets every block (idle_engine.forget_cached_blocks).

How memory is freed: each buffer's storage is resized to 0 bytes, and back at wake-up
(`untyped_storage().resize_`). The tensor objects stay, and with them every view the layers hold
(a layer's k_cache, a state pool's slice, a packed parameter), so nothing has to be bound again.
The buffers are the runner's caches (CACHES: the paged KV cache, the window pool's, the state
pools, the host tier's copies) and, for the weights, every parameter's storage, once each (tied
weights share one). At level 1 a weight's bytes go to a host copy first (pinned, on CUDA) and come
back from it; at level 2 wake_up loads the checkpoint again (with load_format="dummy", the same
random weights), and update_weights while asleep wakes the weights first, so a subset of tensors
updates a whole model.

CUDA graphs: the memory comes back at new addresses, which the captured graphs do not know, so
they are dropped at sleep (their memory pool with them) and captured again at wake-up: the start-up's
capture time again (the log's "CUDA graphs: N batch sizes captured in S s"). Keeping the addresses
(vLLM's CuMemAllocator maps new physical pages under the old virtual ones) would save that time; it
needs the CUDA driver's virtual memory API under PyTorch's allocator.
"""
import ctypes
import logging
from dataclasses import dataclass, field
from time import perf_counter

import torch

from nanovllm.features.idle_engine import check_idle, forget_cached_blocks, on_every_rank
from nanovllm.utils.loader import load_model

logger = logging.getLogger(__name__)

LEVELS = (1, 2)
TAGS = ("weights", "kv_cache")
# The runner's caches, by attribute: ModelRunner's paged KV cache, WindowRunner's window pool
# (features/window_blocks.py), StateRunner's state pools (features/state_cache.py).
CACHES = ("kv_cache", "window_cache", "conv_states", "ssm_states")


@dataclass
class SleepState:
    """A rank's runner asleep (runner.sleep_state; None awake): each freed storage with its size in
    bytes (the storage objects are kept: a resized one has no address to find it by)."""
    weights_level: int  # 0: weights in place; 1: in host copies; 2: dropped
    weights: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = field(default_factory=list)  # (.., copy)
    caches: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)


def sleep(llm, level: int = 1):
    """Free the KV cache (and, level 2, drop the weights) on every rank; the engine idle."""
    if isinstance(level, bool) or level not in LEVELS:
        raise ValueError(f"sleep level must be 1 (weights to host memory) or 2 (weights dropped), got {level!r}")
    check_idle(llm, "sleep")
    if llm.asleep:
        raise ValueError(f"the engine is asleep already (level {llm.asleep}): wake_up() first")
    config = llm.config
    if level == 2 and config.quant_config is not None:
        raise ValueError(f"sleep(level=2) is not supported for a quantized model ({config.quant_config.method!r}): "
                         f"its weights would have to be quantized again at wake-up; use level=1")
    if level == 2 and getattr(llm.model_runner, "drafter", None) is not None:
        raise ValueError("sleep(level=2) is not supported with a draft model (its weights are not reloaded); "
                         "use level=1")
    forget_cached_blocks(llm.block_manager)  # (its blocks' KV is about to be gone)
    on_every_rank(llm, sleep_rank, level)
    llm.asleep = level


def wake_up(llm, tags: list[str] | None = None):
    """Bring back what sleep() freed: tags "weights" and/or "kv_cache" (None: both); awake, a no-op."""
    if tags is None:
        tags = list(TAGS)
    if not isinstance(tags, (list, tuple)) or not tags or any(t not in TAGS for t in tags):
        raise ValueError(f"wake_up tags must be a non-empty list of {TAGS}, got {tags!r}")
    if not llm.asleep:
        return
    start = perf_counter()
    on_every_rank(llm, wake_rank, tuple(tags))
    if getattr(llm.model_runner, "sleep_state", None) is None:
        llm.asleep = 0
        logger.info("Awake in %.2f s (CUDA graphs captured again: %s)", perf_counter() - start,
                    "yes" if llm.model_runner.graphs is not None else "none in use")


# ---- a rank's part ----------------------------------------------------------------------------
def sleep_rank(runner, level: int):
    """Free this rank's caches and graphs, and its weights' device memory (level 1 on CUDA: to host copies)."""
    drop_graphs(runner)
    state = SleepState(weights_level=level if level == 2 or runner.device.type == "cuda" else 0)
    state.caches = [(storage, storage.nbytes()) for storage in cache_storages(runner)]
    if state.weights_level:
        state.weights = [(storage, storage.nbytes(), host_copy(storage) if state.weights_level == 1 else None)
                         for storage in weight_storages(runner)]
    for storage, *_ in state.caches + state.weights:
        storage.resize_(0)
    runner.sleep_state = state
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()  # (the freed blocks back to the driver: the trainer's to take)
    else:
        trim_host_heap()


def trim_host_heap():
    """Hand the C heap's free memory back to the OS. glibc's malloc serves allocations under its
    mmap threshold (up to 32 MiB once raised) from the heap, and free() keeps their pages: a
    model's many 8 MB weights would stay resident after sleep. (No glibc: nothing to do.)"""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


def wake_rank(runner, tags: tuple[str, ...]):
    """Bring back this rank's weights and/or caches; with both back, its CUDA graphs captured again."""
    state = getattr(runner, "sleep_state", None)
    if state is None:
        return
    if "weights" in tags and state.weights_level:
        wake_weights(runner, state)
    if "kv_cache" in tags and state.caches:
        for storage, nbytes in state.caches:
            storage.resize_(nbytes)
            as_bytes(storage).zero_()  # (a state pool's slot must start from zeros)
        state.caches = []
    if not state.weights_level and not state.caches:
        runner.sleep_state = None
        runner._capture(runner.config)  # (the graphs read the new addresses)


def wake_weights(runner, state: SleepState):
    """Weights back: from their host copies (level 1), or the checkpoint again (level 2)."""
    for storage, nbytes, backup in state.weights:
        storage.resize_(nbytes)
        if backup is not None:
            as_bytes(storage).copy_(backup)
    if state.weights_level == 2:
        reload_checkpoint(runner)
    state.weights_level, state.weights = 0, []


def reload_checkpoint(runner):
    """Level 2's wake-up: the weights as at start-up (ModelRunner._load's loading)."""
    config = runner.config
    if config.load_format == "dummy":
        from nanovllm.utils.dummy_weights import load_dummy  # (benchmarks': loaded when they ask)
        load_dummy(runner.model)
    else:
        load_model(runner.model, config.model, show_progress=False)


# ---- storages -----------------------------------------------------------------------------------
def drop_graphs(runner):
    """The runner's CUDA graphs (and their memory pool) let go: they hold the old addresses."""
    runner.graphs = None
    if hasattr(runner, "verify_graphs"):  # (speculative decoding's, and its draft model's)
        runner.verify_graphs = None
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        drafter.graphs = None


def cache_storages(runner) -> list[torch.UntypedStorage]:
    """The storage of each cache of the runner (and of its draft model, and the host tier's copies)."""
    owners = [runner, getattr(runner, "drafter", None)]
    tensors = [getattr(owner, name, None) for owner in owners if owner is not None for name in CACHES]
    if runner.host_copies is not None:
        tensors.append(runner.host_copies.cache)
    return unique_storages(t for t in tensors if t is not None)


def weight_storages(runner) -> list[torch.UntypedStorage]:
    models = [runner.model] + ([runner.drafter.model] if getattr(runner, "drafter", None) is not None else [])
    return unique_storages(p for model in models for p in model.parameters())


def unique_storages(tensors) -> list[torch.UntypedStorage]:
    """Each distinct storage once (tied weights, views of one cache share theirs)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages.setdefault((storage.device, storage.data_ptr()), storage)
    return list(storages.values())


def host_copy(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes in host memory (pinned: the copy back at wake-up is one DMA)."""
    data = as_bytes(storage)
    return torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True).copy_(data)


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
