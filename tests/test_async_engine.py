"""The engine behind asyncio (entrypoints/async_engine.py), in process: many coroutines share one
engine thread; each gets exactly its own results; bad requests, aborts and a failing engine
disturb nobody else; and the `nanovllm` command's flags are LLM's options."""
import asyncio
import dataclasses
import random
import threading

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.config import OPTIONS, Config
from nanovllm.cli import build_parser
from nanovllm.entrypoints.args import llm_from_args
from nanovllm.entrypoints.async_engine import AsyncEngine, EngineDead, QueueFull, ShuttingDown, TooLarge, updates

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture
def llm(model_dir):
    return LLM(model_dir, max_model_len=512)


async def until(condition, timeout: float = 5.0):
    """Wait for condition() to hold (the engine thread gets there within a few steps)."""
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


def all_blocks_free(llm) -> bool:
    stats = llm.stats()
    return stats["num_free_blocks"] == stats["num_blocks"]


async def run_one(engine, prompt, params, stream=True) -> dict:
    """A request's whole output, from its updates: token ids, text, finish reason."""
    request = await engine.submit(prompt, params, stream=stream)
    out = {"token_ids": [], "text": "", "finish_reason": None, "num_updates": 0}
    async for _, update in updates([request]):
        out["token_ids"] += update["token_ids"]
        out["text"] += update["text"] or ""
        out["num_updates"] += 1
        if update["finished"]:
            out["finish_reason"] = update["finish_reason"]
    return out


def test_concurrent_requests_each_get_exactly_their_outputs(llm):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 512) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in prompts]
    expected = llm.generate(prompts, params, use_tqdm=False)
    engine = AsyncEngine(llm)

    async def main():
        return await asyncio.gather(*(run_one(engine, p, sp, stream=i % 2 == 0)
                                      for i, (p, sp) in enumerate(zip(prompts, params))))
    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [r["token_ids"] for r in results] == [e["token_ids"] for e in expected]
    assert [r["text"] for r in results] == [e["text"] for e in expected]
    assert all(r["num_updates"] == 1 for r in results[1::2])  # not streamed: one update, at the end
    assert all_blocks_free(llm)


def test_a_bad_request_is_refused_and_the_others_finish(llm):
    engine = AsyncEngine(llm)
    expected = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]

    async def main():
        good = asyncio.create_task(run_one(engine, [1, 2, 3], GREEDY))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.submit([1, 10**6], GREEDY)
        with pytest.raises(ValueError, match="empty prompt"):
            await engine.submit([], GREEDY)
        with pytest.raises(ValueError, match="600 tokens or more, which leaves no room to generate within "
                                             "max_model_len"):
            await engine.submit([1] * 600, GREEDY)
        return await good
    try:
        assert asyncio.run(main())["token_ids"] == expected
    finally:
        engine.shutdown()


def test_the_prompts_of_one_call_are_queued_all_or_none(llm):
    engine = AsyncEngine(llm)
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def main():
        with pytest.raises(ValueError, match="top_k=1000 exceeds"):
            engine.submit_all([[1, 2], [3, 4], [4, 5]], [long, SamplingParams(top_k=1000), long])
        requests = engine.submit_all([[1, 2], [3, 4]], [GREEDY, GREEDY])
        return [u for _, u in [x async for x in updates(requests)] if u["finished"]]
    try:
        finals = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(finals) == 2
    assert llm.is_finished() and all_blocks_free(llm)


def test_prompts_are_tokenized_off_the_engine_thread(llm):
    """encode() renders and tokenizes on a tokenizer thread: neither the event loop nor the
    engine thread waits for it."""
    engine = AsyncEngine(llm)
    threads = []
    encode = llm.tokenizer.encode

    def recording_encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)
    llm.tokenizer.encode = recording_encode
    try:
        ids = asyncio.run(engine.encode("the quick brown fox"))
    finally:
        llm.tokenizer.encode = encode
        engine.shutdown()
    assert ids == encode("the quick brown fox") and len(threads) == 1
    assert threads[0].startswith("nanovllm-tokenizer")


def test_abort_frees_the_blocks_and_abort_all_ends_every_stream(llm):
    engine = AsyncEngine(llm)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        first = await engine.submit([1, 2, 3], long, stream=True)
        second = await engine.submit([4, 5, 6], long, stream=True)
        stream = updates([first]).__aiter__()
        await stream.__anext__()
        engine.abort(first)
        for _ in range(200):  # the engine thread frees them within a step
            if engine.stats["num_running"] == 1:
                break
            await asyncio.sleep(0.01)
        assert engine.stats["num_running"] == 1
        engine.abort_all()
        finals = [u async for _, u in updates([second]) if u["finished"]]
        return finals
    try:
        finals = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [u["finish_reason"] for u in finals] == ["abort"]
    assert all_blocks_free(llm)


def test_queue_limit(model_dir):
    engine = AsyncEngine(LLM(model_dir, max_model_len=512, max_num_seqs=1), max_queued_requests=1)
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def main():
        await engine.submit([1], long)  # runs, in the one sequence slot
        await until(lambda: engine.stats["num_running"] == 1)
        await engine.submit([2], long)  # waits
        await until(lambda: engine.stats["num_waiting"] == 1)
        with pytest.raises(QueueFull, match="1 sequences may wait .* 1 are waiting already"):
            await engine.submit([3], GREEDY)
        with pytest.raises(TooLarge, match="2 sequences"):  # (never fits: a 400, not a 503, in the server)
            await engine.submit([3], SamplingParams(n=2))
        engine.close()
        with pytest.raises(ShuttingDown):
            await engine.submit([3], GREEDY)
    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="max_queued_requests"):
        AsyncEngine(engine.llm, max_queued_requests=0)



def park_steps(llm) -> tuple[threading.Event, threading.Event]:
    """From now on each of llm's steps sets `parked` and waits for `go` before it runs: the engine
    thread held inside a step, taking no command, until the test lets it go."""
    step, parked, go = llm.step, threading.Event(), threading.Event()

    def parking_step():
        parked.set()
        go.wait()
        return step()
    llm.step = parking_step
    return parked, go


def test_calls_in_one_tick_count_each_others_sequences_against_the_queue_limit(model_dir):
    """Calls made back to back, with no await between (one event-loop tick, the engine thread
    parked in a step and taking no command), are admitted against the limit with the sequences
    of the calls before them, queued but not yet taken by the engine thread: the burst stops at
    max_queued_requests."""
    llm = LLM(model_dir, max_model_len=512, max_num_seqs=1)
    parked, go = park_steps(llm)
    engine = AsyncEngine(llm, max_queued_requests=3)
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def main():
        first = engine.submit_all([[1]], [long])
        await until(parked.is_set)  # (it waits in the engine: the snapshot before the step counts it)
        assert engine.stats["num_waiting"] == 1
        burst = [engine.submit_all([[2 + i]], [GREEDY]) for i in range(2)]  # 1 + 2: the limit
        with pytest.raises(QueueFull, match="3 sequences may wait .* 3 are waiting already"):
            engine.submit_all([[9]], [GREEDY])
        with pytest.raises(QueueFull):
            engine.submit_all([[9], [10]], [GREEDY] * 2)
        go.set()
        return [u["finish_reason"] for call in (first, *burst) async for _, u in updates(call) if u["finished"]]
    try:
        assert asyncio.run(main()) == ["length"] * 3
    finally:
        go.set()
        engine.shutdown()


def test_calls_in_one_tick_count_each_prompt_n_times_against_the_queue_limit(model_dir):
    """As above, with n: a call of one prompt x n=3 queued behind the engine thread (parked in a
    step) counts 3 sequences, so with the one waiting in the engine the limit of 4 is reached and the
    next call is refused."""
    llm = LLM(model_dir, max_model_len=512, max_num_seqs=1)
    parked, go = park_steps(llm)
    engine = AsyncEngine(llm, max_queued_requests=4)

    async def main():
        first = engine.submit_all([[1]], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)])
        await until(parked.is_set)
        assert engine.stats["num_waiting"] == 1
        three = engine.submit_all([[2]], [SamplingParams(n=3, seed=0, max_tokens=4, ignore_eos=True)])  # 1 + 3
        with pytest.raises(QueueFull, match="4 sequences may wait .* 4 are waiting already"):
            engine.submit_all([[9]], [GREEDY])
        go.set()
        return [u["finish_reason"] for call in (first, three) async for _, u in updates(call) if u["finished"]]
    try:
        assert asyncio.run(main()) == ["length"] * 4
    finally:
        go.set()
        engine.shutdown()


def test_the_engine_thread_feeds_the_engine_n_sequences_for_a_prompt_of_n(model_dir):
    """max_num_seqs 2: of one call's prompts, the first, n=2, fills the engine's waiting room (it and
    its fork), so the second, n=1, stays held by the engine thread; both count as waiting."""
    llm = LLM(model_dir, max_model_len=512, max_num_seqs=2)
    parked, go = park_steps(llm)
    engine = AsyncEngine(llm)

    async def main():
        call = engine.submit_all([[1, 2], [3, 4]], [SamplingParams(n=2, seed=0, max_tokens=4, ignore_eos=True),
                                                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
        await until(parked.is_set)  # (the snapshot before the step: what was fed, and what is held)
        assert llm.stats()["num_waiting"] == 2 and engine.stats["num_waiting"] == 3
        go.set()
        return [u["finish_reason"] async for _, u in updates(call) if u["finished"]]
    try:
        assert asyncio.run(main()) == ["length"] * 3
    finally:
        go.set()
        engine.shutdown()
    assert all_blocks_free(llm)


def test_a_held_request_counts_its_n_samples_as_waiting_and_against_the_limit(model_dir):
    """max_num_seqs 1: one prompt runs, one waits in the engine, and an n=3 one is held by the engine
    thread: 4 sequences wait (the server's num_requests_waiting), so with a limit of 5 an n=2 call is
    refused and an n=1 one admitted; the n=3 one aborted while held, all 3 stop waiting."""
    llm = LLM(model_dir, max_model_len=512, max_num_seqs=1)
    engine = AsyncEngine(llm, max_queued_requests=5)
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    three = SamplingParams(n=3, seed=0, max_tokens=500, ignore_eos=True)

    async def main():
        running = engine.submit_all([[1, 2]], [long])
        await until(lambda: engine.stats["num_running"] == 1)
        call = engine.submit_all([[3, 4], [5, 6]], [long, three])
        await until(lambda: engine.stats["num_waiting"] > 0)  # (one snapshot counts both: fed, and held)
        assert engine.stats["num_waiting"] == 4
        with pytest.raises(QueueFull, match="4 are waiting already"):
            engine.submit_all([[7]], [SamplingParams(n=2, seed=0)])
        last = engine.submit_all([[7]], [GREEDY])  # 5: the limit
        await until(lambda: engine.stats["num_waiting"] == 5)
        engine.abort(call[1])
        await until(lambda: engine.stats["num_waiting"] != 5)
        assert engine.stats["num_waiting"] == 2
        engine.abort_all()
        return [u["finish_reason"] for c in (running, call[:1], last) async for _, u in updates(c) if u["finished"]]
    try:
        assert asyncio.run(main()) == ["abort"] * 3
    finally:
        engine.shutdown()
    assert all_blocks_free(llm)


def test_calls_are_admitted_in_turn(model_dir):
    """Fairness: a call of many prompts does not hold back a later call until all of them have
    run. The engine thread hands the engine the calls' requests in turn, keeping no more than
    max_num_seqs sequences waiting in it; first come, first served would finish the later call
    last, after all 12 of the first."""
    engine = AsyncEngine(LLM(model_dir, max_model_len=512, max_num_seqs=2))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def main():
        order = []

        async def finishes(name, requests):
            async for i, update in updates(requests):
                if update["finished"]:
                    order.append((name, i))
        big = engine.submit_all([[i + 1, 7] for i in range(12)], [params] * 12)
        first = asyncio.create_task(finishes("big", big))
        while engine.stats["num_running"] < 2:  # the first call runs, two of its prompts wait
            await asyncio.sleep(0.005)
        assert engine.stats["num_waiting"] == 10
        await finishes("small", engine.submit_all([[99, 98]], [params]))
        await first
        return order
    try:
        order = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(order) == 13 and order.index(("small", 0)) <= 6, order


def test_held_requests_are_dropped_by_abort_and_ended_by_abort_all(model_dir):
    """With one sequence slot, one prompt waits in the engine and the rest are held by the engine
    thread: abort() drops a held one (its client went away), abort_all() ends every one, held or
    not, with its last update."""
    llm = LLM(model_dir, max_model_len=512, max_num_seqs=1)
    engine = AsyncEngine(llm)
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def main():
        running = engine.submit_all([[1, 2]], [long])
        await until(lambda: engine.stats["num_running"] == 1)
        held = engine.submit_all([[3, 4], [5, 6], [7, 8]], [long] * 3)
        await until(lambda: engine.stats["num_waiting"] == 3)
        assert len(llm.scheduler.waiting) == 1  # (the other two are held)
        engine.abort(held[2])
        await until(lambda: engine.stats["num_waiting"] == 2)
        engine.abort_all()
        return [u["finish_reason"] for call in (running, held[:2]) async for _, u in updates(call) if u["finished"]]
    try:
        assert asyncio.run(main()) == ["abort"] * 3
    finally:
        engine.shutdown()
    assert all_blocks_free(llm)


def failing_engine(llm) -> AsyncEngine:
    """An AsyncEngine over llm whose every step raises."""
    def broken_step():
        raise RuntimeError("the device fell off")
    llm.step = broken_step
    return AsyncEngine(llm)


async def a_request_fails(engine):
    request = await engine.submit([1, 2, 3], GREEDY)
    with pytest.raises(EngineDead, match="fell off"):
        async for _ in updates([request]):
            pass


def test_a_failing_engine_fails_every_request_and_refuses_new_ones(llm):
    engine = failing_engine(llm)

    async def main():
        await a_request_fails(engine)
        with pytest.raises(EngineDead):
            await engine.submit([1, 2, 3], GREEDY)
    asyncio.run(main())
    engine._thread.join(timeout=5)
    assert isinstance(engine.error, RuntimeError)


def test_every_llm_option_is_a_flag():
    defaults = {f.name: f.default for f in dataclasses.fields(Config) if f.init and f.name != "model"}
    assert list(defaults) == list(OPTIONS) and "max_model_len" in defaults
    for command in ("serve", "chat"):
        args = build_parser().parse_args([command, "M"])
        assert {name: getattr(args, name) for name in defaults} == defaults
    args = build_parser().parse_args(["serve", "M", "--max-model-len", "77", "--no-enable-prefix-caching",
                                      "--enforce-eager", "--gpu-memory-utilization", "0.5", "--dtype", "float32",
                                      "--num-kvcache-blocks", "9", "--port", "9001", "--api-key", "k"])
    assert (args.max_model_len, args.enable_prefix_caching, args.enforce_eager, args.gpu_memory_utilization,
            args.dtype, args.num_kvcache_blocks, args.port, args.api_key) == (77, False, True, 0.5, "float32", 9, 9001, "k")
    with pytest.raises(ValueError, match="does not exist"):
        llm_from_args(args)  # the engine's own validation


def test_a_call_after_a_request_failed_with_the_engine_is_refused_at_once(llm, monkeypatch):
    """The engine fails: a client that has seen its request fail with EngineDead and calls again
    is refused by that call (EngineDead), not queued to fail later. Deterministic: the engine
    thread is held right after it fails each request in flight until the client has called again,
    the window in which a failure reached the client before the engine's error was set."""
    from nanovllm.entrypoints import async_engine
    called_again, fail = threading.Event(), async_engine.Request.fail

    def fail_and_wait(self, error):
        fail(self, error)
        called_again.wait(timeout=60)  # (a fail-safe only: main() sets it whatever happens)
    monkeypatch.setattr(async_engine.Request, "fail", fail_and_wait)
    engine = failing_engine(llm)

    async def main():
        await a_request_fails(engine)
        try:
            with pytest.raises(EngineDead, match="fell off"):
                await engine.submit([1, 2, 3], GREEDY)
        finally:
            called_again.set()
    asyncio.run(main())
    engine._thread.join(timeout=5)
    assert isinstance(engine.error, RuntimeError) and not engine._thread.is_alive()
