"""What bench.py measures of each step, in one object it attaches with
`LLMEngine.attach_recorder(StepRecorder(...))` (without one, the step path only tests
`recorder is not None`). The engine calls step_accounted() after each step it accounts for; the
model runner calls device_step_started() when it starts a step's device work (a draft model's
first: on CUDA the start event, recorded on an idle stream, marks when the host got to the step,
not when the previous step ended) and device_step_ended() once its sampling is queued.
"""
from time import perf_counter

import torch


class StepRecorder:
    def __init__(self, device: str = "cpu", timeline: bool = False):
        # Throughput since attached (a step with any prefill tokens counts as prefill time);
        # sampling_forwards: forwards that end in sampling (1 per output token but for speculation)
        self.totals = {"prefill_tokens": 0, "prefill_time_s": 0.0, "decode_tokens": 0, "decode_time_s": 0.0,
                       "sampling_forwards": 0}
        # timeline: a dict per step accounted for (the host's share of its wall time: all but launching
        # the model and waiting for the tokens; decode tokens include a speculative decode's drafts)
        self.records: list[dict] | None = [] if timeline else None
        # CUDA: (decode only?, start event, end event) per launched step
        self.cuda_events: list | None = [] if device == "cuda" else None
        self._last = perf_counter()  # when the last accounted step ended
        self._device_start = 0.0
        self._device_s = 0.0          # host time spent launching steps since then
        self._start_event = None

    def device_step_started(self):
        self._device_start = perf_counter()
        if self.cuda_events is not None:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()

    def device_step_ended(self, batch):
        self._device_s += perf_counter() - self._device_start
        if self.cuda_events is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.cuda_events.append((bool((batch.num_new == 1).all()), self._start_event, end))

    def step_accounted(self, done, engine, tokens: list):
        """done: the engine's InFlightStep just accounted for; tokens: what it sampled (a list per
        sequence in a speculative step: its accepted drafts and the token after them)."""
        now = perf_counter()
        step_s, self._last = now - self._last, now
        step = done.step
        num_tokens = sum(step.num_new)
        step_drafts = getattr(step, "drafts", {})  # (a SpeculativeStep's: {index: its drafts})
        drafts = [step_drafts.get(i, 0) for i in range(len(step.seqs))]  # (a speculative decode: 1 + its drafts)
        kind = "decode" if all(n == 1 + d for n, d in zip(step.num_new, drafts)) else "prefill"
        self.totals[f"{kind}_tokens"] += num_tokens
        self.totals[f"{kind}_time_s"] += step_s
        self.totals["sampling_forwards"] += len(step.sampling)
        if self.records is not None:
            num_decode = sum(n for samples, n, start, d in zip(step.samples, step.num_new, step.starts, drafts)
                             if samples and n == 1 + d and start > 0)  # (a speculative decode: its drafts too)
            emitted = sum(map(len, tokens)) if step_drafts else len(tokens)
            stats = engine.stats()
            self.records.append({
                "start": now - step_s, "step_s": step_s,
                "host_s": max(0.0, step_s - self._device_s - done.sampled.wait_s),
                "num_seqs": len(step.seqs), "prefill_tokens": num_tokens - num_decode, "decode_tokens": num_decode,
                "draft_tokens": sum(step_drafts.values()), "emitted_tokens": emitted,
                "used_blocks": stats["num_blocks"] - stats["num_free_blocks"], "preemptions": stats["num_preemptions"]})
        self._device_s = 0.0

    def gpu_idle_fraction(self) -> float | None:
        """Share of the wall time of consecutive decode steps in which the GPU had nothing to do:
        from one step's end to the next step's start, as their CUDA events timed them."""
        if not self.cuda_events:
            return None
        torch.cuda.synchronize()
        idle = total = 0.0
        for (decode, _, end), (next_decode, next_start, next_end) in zip(self.cuda_events, self.cuda_events[1:]):
            if decode and next_decode:
                idle += end.elapsed_time(next_start)
                total += end.elapsed_time(next_end)
        return idle / total if total else None
