"""Prometheus metrics of a serving engine, named as vLLM names its own (prefix `nanovllm:`).

Gauges are set from the engine thread's snapshot after each step; counters and histograms are fed
by the engine thread as it steps (prometheus-client is thread-safe).
"""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from nanovllm.engine.sequence import Sequence

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)


class ServingMetrics:
    """The metrics of one server, in a registry of their own (so several can live in one process)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.running = Gauge("nanovllm:num_requests_running", "Sequences in the running batch.", registry=r)
        self.waiting = Gauge("nanovllm:num_requests_waiting", "Sequences waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge("nanovllm:kv_cache_usage_perc",
                              "KV cache usage: blocks held by requests over all blocks (0 to 1).", registry=r)
        self.host_blocks = Gauge("nanovllm:host_cache_blocks", "Blocks the host tier of the prefix cache holds "
                                 "(0: no host tier).", registry=r)
        self.host_usage = Gauge("nanovllm:host_cache_usage_perc", "Host tier usage: its blocks holding a cached "
                                "block over all of them (0 to 1).", registry=r)
        self.prompt_tokens = Counter("nanovllm:prompt_tokens", "Prompt tokens of the requests received.",
                                     registry=r)
        self.generation_tokens = Counter("nanovllm:generation_tokens", "Tokens generated and returned.", registry=r)
        self.prefix_cache_hits = Counter("nanovllm:prefix_cache_hit_tokens",
                                         "Prompt tokens served by the prefix cache.", registry=r)
        self.prefix_cache_queries = Counter("nanovllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.", registry=r)
        self.host_cache_queries = Counter("nanovllm:host_cache_queries", "Prompt tokens looked up in the host "
                                          "tier of the prefix cache (those the device tier missed).", registry=r)
        self.host_cache_hits = Counter("nanovllm:host_cache_hit_tokens", "Prompt tokens the host tier served "
                                       "(reloaded to the device).", registry=r)
        self.kv_offloaded = Counter("nanovllm:kv_offload_bytes", "KV bytes copied to the host tier (rank 0).",
                                    registry=r)
        self.kv_reloaded = Counter("nanovllm:kv_reload_bytes", "KV bytes copied back from the host tier (rank 0).",
                                   registry=r)
        self.kv_copy_time = Counter("nanovllm:kv_copy_seconds", "Time the host tier's copies took (rank 0).",
                                    registry=r)
        self.preemptions = Counter("nanovllm:num_preemptions", "Sequences preempted (to be recomputed).",
                                   registry=r)
        self.ttft = Histogram("nanovllm:time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("nanovllm:time_per_output_token_seconds", "Mean time per output token after the first.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("nanovllm:e2e_request_latency_seconds", "Arrival to finish of a sequence.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.spec_drafts = Counter("nanovllm:spec_decode_num_drafts", "Speculative steps' drafts (one per sequence "
                                   "that drafted).", registry=r)
        self.spec_draft_tokens = Counter("nanovllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.spec_accepted_tokens = Counter("nanovllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                            registry=r)
        self.spec_accepted_per_pos = Counter("nanovllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by their position in the draft.", ["position"],
                                             registry=r)
        self._last: dict = {}  # the engine's cumulative counts, last seen

    def request_added(self, num_prompt_tokens: int):
        self.prompt_tokens.inc(num_prompt_tokens)

    def tokens_generated(self, num_tokens: int):
        if num_tokens:
            self.generation_tokens.inc(num_tokens)

    def sequence_finished(self, seq: Sequence):
        m = seq.metrics()
        if m["ttft_s"] is not None:
            self.ttft.observe(m["ttft_s"])
        if m["tpot_s"] is not None:
            self.tpot.observe(m["tpot_s"])
        self.e2e.observe(m["finish_time"] - m["arrival_time"])

    def stepped(self, stats: dict):
        """After a step: the gauges from the engine thread's snapshot (AsyncEngine.stats), the
        counters from the engine's cumulative counts in it."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.kv_usage.set(stats["kv_cache_usage"])
        self.host_blocks.set(stats["num_host_blocks"])
        self.host_usage.set(stats["num_host_blocks_used"] / max(1, stats["num_host_blocks"]))
        for key, counter in (("num_cached_tokens", self.prefix_cache_hits), ("num_preemptions", self.preemptions),
                             ("spec_num_drafts", self.spec_drafts), ("spec_num_draft_tokens", self.spec_draft_tokens),
                             ("spec_num_accepted_tokens", self.spec_accepted_tokens),
                             ("prefix_cache_queries", self.prefix_cache_queries),
                             ("host_cache_queries", self.host_cache_queries), ("host_cache_hits", self.host_cache_hits),
                             ("kv_offloaded_bytes", self.kv_offloaded), ("kv_reloaded_bytes", self.kv_reloaded),
                             ("kv_copy_time_s", self.kv_copy_time)):
            self._advance(counter, key, stats[key])
        for position, value in enumerate(stats["spec_num_accepted_tokens_per_pos"]):
            self._advance(self.spec_accepted_per_pos.labels(position=str(position)), f"per_pos_{position}", value)

    def _advance(self, counter, key: str, value: int):
        """Advance counter by how much the engine's cumulative count `key` grew since last seen."""
        if value != self._last.get(key, 0):
            counter.inc(value - self._last.get(key, 0))
            self._last[key] = value
