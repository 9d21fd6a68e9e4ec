"""An engine's figures for the server's /metrics and for bench.py: LLMEngine.stats()."""

NO_COPIES = {"offloaded_bytes": 0, "reloaded_bytes": 0, "copy_time_s": 0.0}  # without a host tier


class SpecCounts:
    """The speculative counts without speculative decoding (features/speculative/policy.py's SpecStats: with)."""
    num_drafts = num_draft_tokens = num_accepted_tokens = 0
    accepted_per_position = ()


def engine_stats(engine) -> dict:
    """The engine's state now (KV blocks, sequences) and its cumulative counts: preemptions,
    speculative decoding's, the prompt tokens each cache tier was asked for and served, and the
    host tier's blocks and rank 0's copies (bytes each way, seconds)."""
    bm, scheduler = engine.block_manager, engine.scheduler
    spec = scheduler.spec_stats if engine.config.speculative is not None else SpecCounts()
    device_hits = bm.num_cached_tokens - bm.num_host_hit_tokens
    host_copies = engine.model_runner.host_copies
    copies = host_copies.stats() if host_copies is not None else NO_COPIES
    return {"num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_running": len(scheduler.running), "num_waiting": scheduler.num_waiting_samples(),
            "num_preemptions": scheduler.num_preemptions,
            "num_cached_tokens": bm.num_cached_tokens,
            "peak_used_blocks": bm.peak_used_blocks,
            "spec_num_drafts": spec.num_drafts, "spec_num_draft_tokens": spec.num_draft_tokens,
            "spec_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_num_accepted_tokens_per_pos": list(spec.accepted_per_position),
            "tp_message_bytes": engine.model_runner.last_message_bytes,
            "prefix_cache_queries": bm.num_queried_tokens, "prefix_cache_hits": device_hits,
            "num_host_blocks": bm.host.num_slots if bm.host is not None else 0,
            "num_host_blocks_used": bm.host.num_used if bm.host is not None else 0,
            "host_cache_queries": bm.num_queried_tokens - device_hits, "host_cache_hits": bm.num_host_hit_tokens,
            "kv_offloaded_bytes": copies["offloaded_bytes"], "kv_reloaded_bytes": copies["reloaded_bytes"],
            "kv_copy_time_s": copies["copy_time_s"]}
