"""What the operations on an idle engine share (issue 50's: update_weights, sleep, reset_prefix_cache):
the check that nothing is in flight, a function run on every rank, and the prefix cache forgotten."""
from nanovllm.engine.block_manager import BlockManager


def check_idle(llm, what: str):
    if not llm.is_finished():
        raise ValueError(f"{what} needs the engine idle: requests are in flight (let them finish, or abort them)")


def reset_prefix_cache(llm):
    """Forget every cached prefix (the engine idle): no later request reuses KV or state computed before."""
    check_idle(llm, "reset_prefix_cache")
    forget_cached_blocks(llm.block_manager)


def forget_cached_blocks(manager: BlockManager):
    """Every block's key and contents forgotten (all free: the engine is idle), and with them the
    host tier's entries, the state cache's snapshots and the window pool's keys."""
    for block in manager.blocks:
        block.hash, block.token_ids, block.uid, block.parent_uid = None, None, None, None
    manager.hash_to_block.clear()
    if manager.host is not None:
        manager.host = type(manager.host)(manager.host.num_slots)
    snapshots = getattr(manager, "snapshots", None)  # (features/state_cache.py's)
    if snapshots:
        manager.free_snapshot_slots.extend(snapshots.values())
        snapshots.clear()
    window = getattr(manager, "window", None)  # (features/window_blocks.py's pool of its own)
    if isinstance(window, BlockManager):
        forget_cached_blocks(window)


def on_every_rank(llm, function, *args):
    """function(runner, *args) on every rank: the workers' first (they run it while rank 0 does)."""
    runner = llm.model_runner
    if runner.workers is not None:
        runner.workers.call(function, *args)
    function(runner, *args)
