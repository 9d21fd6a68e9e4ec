"""Prometheus metrics of a serving engine, named as vLLM names its own (prefix `nanovllm:`), all set or
fed by the engine thread as it steps (prometheus-client is thread-safe)."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)

# Gauges set from the engine thread's snapshot (AsyncEngine.stats): its key -> (metric name, help).
GAUGES = {
    "num_running": ("num_requests_running", "Sequences in the running batch."),
    "num_waiting": ("num_requests_waiting", "Sequences waiting to be scheduled."),
    "kv_cache_usage": ("kv_cache_usage_perc", "KV cache usage: blocks held by requests over all blocks (0 to 1)."),
    "num_host_blocks": ("host_cache_blocks", "Blocks the host tier of the prefix cache holds (0: no host tier)."),
}
# Counters that follow the engine's cumulative counts in the snapshot: its key -> (metric name, help).
CACHE_COUNTS = {
    "num_cached_tokens": ("prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "host_cache_queries": ("host_cache_queries", "Prompt tokens looked up in the host tier of the prefix cache "
                           "(those the device tier missed)."),
    "host_cache_hits": ("host_cache_hit_tokens", "Prompt tokens the host tier served (reloaded to the device)."),
    "kv_offloaded_bytes": ("kv_offload_bytes", "KV bytes copied to the host tier (rank 0)."),
    "kv_reloaded_bytes": ("kv_reload_bytes", "KV bytes copied back from the host tier (rank 0)."),
    "kv_copy_time_s": ("kv_copy_seconds", "Time the host tier's copies took (rank 0)."),
    "num_preemptions": ("num_preemptions", "Sequences preempted (to be recomputed)."),
}
SPEC_COUNTS = {
    "spec_num_drafts": ("spec_decode_num_drafts", "Speculative steps' drafts (one per sequence that drafted)."),
    "spec_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}


class ServingMetrics:
    """The metrics of one server, in a registry of their own (so several can live in one process)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.gauges = {key: Gauge(f"nanovllm:{name}", text, registry=r) for key, (name, text) in GAUGES.items()}
        self.host_usage = Gauge("nanovllm:host_cache_usage_perc", "Host tier usage: its blocks holding a cached "
                                "block over all of them (0 to 1).", registry=r)
        self.prompt_tokens = Counter("nanovllm:prompt_tokens", "Prompt tokens of the requests received.",
                                     registry=r)
        self.generation_tokens = Counter("nanovllm:generation_tokens", "Tokens generated and returned.", registry=r)
        self.counts = {key: Counter(f"nanovllm:{name}", text, registry=r) for key, (name, text) in CACHE_COUNTS.items()}
        self.ttft = Histogram("nanovllm:time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("nanovllm:time_per_output_token_seconds", "Mean time per output token after the first.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("nanovllm:e2e_request_latency_seconds", "Arrival to finish of a sequence.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.counts |= {key: Counter(f"nanovllm:{name}", text, registry=r) for key, (name, text) in SPEC_COUNTS.items()}
        self.spec_accepted_per_pos = Counter("nanovllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by their position in the draft.", ["position"],
                                             registry=r)
        self._last: dict = {}  # the engine's cumulative counts, last seen

    def request_added(self, num_prompt_tokens: int):
        self.prompt_tokens.inc(num_prompt_tokens)

    def tokens_generated(self, num_tokens: int):
        if num_tokens:
            self.generation_tokens.inc(num_tokens)

    def sequence_finished(self, m: dict):
        """A sequence's Sequence.metrics()."""
        if m["ttft_s"] is not None:
            self.ttft.observe(m["ttft_s"])
        if m["tpot_s"] is not None:
            self.tpot.observe(m["tpot_s"])
        self.e2e.observe(m["finish_time"] - m["arrival_time"])

    def stepped(self, stats: dict):
        """After a step: the gauges and counters from the engine thread's snapshot (AsyncEngine.stats)."""
        for key, gauge in self.gauges.items():
            gauge.set(stats[key])
        self.host_usage.set(stats["num_host_blocks_used"] / max(1, stats["num_host_blocks"]))
        for key, counter in self.counts.items():
            self._advance(counter, key, stats[key])
        for position, value in enumerate(stats["spec_num_accepted_tokens_per_pos"]):
            self._advance(self.spec_accepted_per_pos.labels(position=str(position)), f"per_pos_{position}", value)

    def _advance(self, counter, key: str, value: int):
        """Advance counter by how much the engine's cumulative count `key` grew since last seen."""
        if value != self._last.get(key, 0):
            counter.inc(value - self._last.get(key, 0))
            self._last[key] = value
