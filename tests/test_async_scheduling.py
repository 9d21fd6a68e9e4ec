"""Overlap scheduling (async_scheduling=True, the default) against the synchronous loop.

The overlapped loop launches step N+1 before it accounts for step N: step N's sampled tokens feed
step N+1 on the device, a sequence that step N finished runs one step more and that token is
dropped. On CPU the device work is synchronous, so nothing overlaps, but every line runs: the
outputs must be identical with it on and off, for every feature that touches a step.
"""
import pytest

from test_golden_outputs import OPTIONS as GOLDEN_OPTIONS, PARAMS as GOLDEN_PARAMS, prompts as golden_prompts

from nanovllm import LLM, SamplingParams

MAX_MODEL_LEN = 160


def outputs_both_ways(model_dir, prompts, params, **options):
    """generate() with async scheduling on and off; checks no block leaked either way."""
    results = []
    for async_scheduling in (True, False):
        llm = LLM(model_dir, max_model_len=MAX_MODEL_LEN, async_scheduling=async_scheduling, **options)
        results.append(llm.generate(prompts, params, use_tqdm=False))
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"], f"blocks leaked (async_scheduling={async_scheduling})"
    return results


def comparable(outputs):
    """Everything an output says but its timings and logprobs (compared apart)."""
    def strip(out):
        return {k: v for k, v in out.items() if k not in ("metrics", "samples", "logprobs")}
    return [[strip(s) for s in out.get("samples", [out])] for out in outputs]


def assert_same_logprobs(a, b):
    """The same tokens, log-probabilities equal to float32 rounding: a batch's composition can
    differ between the loops (a stopped sequence runs one step more when overlapped), and a
    matmul's rounding with it."""
    for out_a, out_b in zip(a, b):
        for s, t in zip(out_a.get("samples", [out_a]), out_b.get("samples", [out_b])):
            assert ("logprobs" in s) == ("logprobs" in t)
            for d, e in zip(s.get("logprobs", []), t.get("logprobs", [])):
                assert d.keys() == e.keys() and all(abs(d[k] - e[k]) < 1e-4 for k in d)


def test_async_scheduling_must_be_a_bool(model_dir):
    with pytest.raises(TypeError, match="async_scheduling must be a bool, got 1"):
        LLM(model_dir, async_scheduling=1)


# The golden workload (every sampling control, n, logprobs, stops) and its configurations, on
# this file's model: there they are checked against recorded outputs, here on against off.
WORKLOAD = [SamplingParams(**p) for p in GOLDEN_PARAMS]


@pytest.mark.parametrize("options", list(GOLDEN_OPTIONS.values()), ids=list(GOLDEN_OPTIONS))
def test_outputs_identical_on_and_off(model_dir, options):
    prompts = golden_prompts()  # they share 50 tokens: prefix caching
    params = WORKLOAD + WORKLOAD[1:3]
    overlapped, synchronous = outputs_both_ways(model_dir, prompts, params, **options)
    assert comparable(overlapped) == comparable(synchronous)
    assert_same_logprobs(overlapped, synchronous)


def test_preemption_happens_in_the_preemption_case(model_dir):
    """(The case above is only worth its name if the budget does force preemption.)"""
    llm = LLM(model_dir, max_model_len=MAX_MODEL_LEN, **GOLDEN_OPTIONS["preemption"])
    llm.generate(golden_prompts(), WORKLOAD + WORKLOAD[1:3], use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0


def record_launches(llm):
    """Wrap the scheduler: per launched step, how many of its sequences decode a token whose id
    the host has not read yet (it is in the device's token table only)."""
    launches, schedule = [], llm.scheduler.schedule

    def schedule_and_record():
        step = schedule()
        if step is not None:  # (planning counted each sampling sequence's new token in num_tokens)
            launches.append(sum(start >= len(seq.token_ids) for seq, start in zip(step.seqs, step.starts)))
        return step

    llm.scheduler.schedule = schedule_and_record
    return launches


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_stopped_sequence_runs_one_step_more_and_its_token_is_dropped(model_dir, async_scheduling):
    prompt = [5, 6, 7, 8]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(model_dir, max_model_len=MAX_MODEL_LEN, async_scheduling=async_scheduling)
    free_run = llm.generate([prompt], greedy, use_tqdm=False)[0]["token_ids"]
    stop = free_run[3]
    cut = free_run.index(stop) + 1  # the first time the stop token comes
    launches = record_launches(llm)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out["token_ids"] == free_run[:cut] and out["finish_reason"] == "stop" and out["stop_reason"] == stop
    steps_with_it = len(launches)
    # one launch per sampled token; overlapped, one more whose token is dropped
    assert steps_with_it == cut + (1 if async_scheduling else 0)
    # overlapped, every decode's input token was still on its way to the host when it was launched
    assert sum(launches) == (steps_with_it - 1 if async_scheduling else 0)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    # the engine goes on cleanly after the dropped step
    assert llm.generate([prompt], greedy, use_tqdm=False)[0]["token_ids"] == free_run


def test_no_step_past_the_length_limit(model_dir):
    """A sequence whose in-flight token is its last by max_tokens (or max_model_len) is not
    scheduled again: no wasted step, and no position past max_model_len."""
    llm = LLM(model_dir, max_model_len=24)
    launches = record_launches(llm)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out["token_ids"]) == 5 and len(launches) == 5
    launches.clear()
    out = llm.generate([list(range(1, 21))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]  # 20 + 4 = max_model_len
    assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length" and len(launches) == 4


def test_streams_and_aborts_while_a_step_is_in_flight(model_dir):
    """A stream closed after its first update (its request has a step in flight) frees its
    blocks, and the other requests' streams are unaffected and equal to the synchronous loop's."""
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    results = []
    for async_scheduling in (True, False):
        llm = LLM(model_dir, max_model_len=MAX_MODEL_LEN, async_scheduling=async_scheduling)
        doomed = llm.stream([[30, 31, 32]], params)
        next(doomed)
        stream = llm.stream(prompts, params)
        tokens = {}
        for i, update in enumerate(stream):
            tokens.setdefault(update["index"], []).extend(update["token_ids"])
            if i == 2:
                doomed.close()  # aborted between two steps, with a step of it in flight
        results.append(tokens)
        while not llm.is_finished():  # account for the step still in flight, if any
            llm.step()
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]
    assert results[0] == results[1]
    assert all(len(t) == 15 for t in results[0].values())
