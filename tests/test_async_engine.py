"""The engine behind asyncio (entrypoints/async_engine.py), in process: many coroutines share one
engine thread; each gets exactly its own results; bad requests, aborts and a failing engine
disturb nobody else; and the `nanovllm` command's flags are LLM's options."""
import asyncio
import inspect
import random

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.cli import build_parser
from nanovllm.entrypoints.args import llm_from_args
from nanovllm.entrypoints.async_engine import AsyncEngine, EngineDead, QueueFull, updates

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture
def llm(model_dir):
    return LLM(model_dir, max_model_len=512)


def all_blocks_free(llm) -> bool:
    stats = llm.stats()
    return stats["num_free_blocks"] == stats["num_blocks"]


async def run_one(engine, prompt, params, stream=True, fill_context=False) -> dict:
    """A request's whole output, from its updates: token ids, text, finish reason."""
    request = await engine.submit(prompt, params, stream=stream, fill_context=fill_context)
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
        with pytest.raises(ValueError, match="exceeds max_model_len"):
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
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.submit_all([[1, 2], [3, 10**6], [4, 5]], long)
        requests = await engine.submit_all([[1, 2], [3, 4]], GREEDY)
        return [u for _, u in [x async for x in updates(requests)] if u["finished"]]
    try:
        finals = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(finals) == 2
    assert llm.is_finished() and all_blocks_free(llm)


def test_max_tokens_none_takes_what_the_context_leaves(llm):
    engine = AsyncEngine(llm)
    try:
        out = asyncio.run(run_one(engine, [1] * 500, SamplingParams(temperature=0, ignore_eos=True), stream=False,
                                  fill_context=True))
    finally:
        engine.shutdown()
    assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"


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
        async def until(condition):
            for _ in range(500):
                if condition():
                    return
                await asyncio.sleep(0.01)
        await engine.submit([1], long)  # runs, in the one sequence slot
        await until(lambda: engine.stats["num_running"] == 1)
        await engine.submit([2], long)  # waits
        await until(lambda: engine.stats["num_waiting"] == 1)
        with pytest.raises(QueueFull, match="1 requests are already waiting"):
            await engine.submit([3], GREEDY)
        engine.abort_all()
    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="max_queued_requests"):
        AsyncEngine(engine.llm, max_queued_requests=0)


def test_a_failing_engine_fails_every_request_and_refuses_new_ones(llm):
    def broken_step():
        raise RuntimeError("the device fell off")
    llm.step = broken_step
    engine = AsyncEngine(llm)

    async def main():
        request = await engine.submit([1, 2, 3], GREEDY)
        with pytest.raises(EngineDead, match="fell off"):
            async for _ in updates([request]):
                pass
        with pytest.raises(EngineDead):
            await engine.submit([1, 2, 3], GREEDY)
    asyncio.run(main())
    engine._thread.join(timeout=5)
    assert isinstance(engine.error, RuntimeError)


def test_every_llm_option_is_a_flag():
    options = [name for name, p in inspect.signature(LLM.__init__).parameters.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY]
    for command in ("serve", "chat"):
        args = build_parser().parse_args([command, "M"])
        assert all(getattr(args, name) == inspect.signature(LLM.__init__).parameters[name].default
                   for name in options)
    args = build_parser().parse_args(["serve", "M", "--max-model-len", "77", "--no-enable-prefix-caching",
                                      "--enforce-eager", "--gpu-memory-utilization", "0.5", "--dtype", "float32",
                                      "--num-kvcache-blocks", "9", "--port", "9001", "--api-key", "k"])
    assert (args.max_model_len, args.enable_prefix_caching, args.enforce_eager, args.gpu_memory_utilization,
            args.dtype, args.num_kvcache_blocks, args.port, args.api_key) == (77, False, True, 0.5, "float32", 9, 9001, "k")
    with pytest.raises(ValueError, match="does not exist"):
        llm_from_args(args)  # the engine's own validation
