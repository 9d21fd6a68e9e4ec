"""The server as an RL rollout worker (issue 50): POST /update_weights_from_disk, /reset_prefix_cache,
/sleep and /wake_up (and GET /is_sleeping) on a real `nanovllm serve` subprocess of a tiny model A,
updated to B (same shapes, other random weights) and back. Every answer is checked against A's or B's
greedy completions from LLM.generate offline; 32 streams at once while the weights alternate must each
be exactly A's or exactly B's, never a 5xx, never a mix."""
import asyncio
import json
import random

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
pytest.importorskip("prometheus_client", reason="the serve extra (prometheus-client) is not installed")
httpx = pytest.importorskip("httpx", reason="httpx is not installed")

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.entrypoints.async_engine import PAUSE, Asleep, AsyncEngine, EngineDead, updates  # noqa: E402
from nanovllm.utils.tiny_model import build_model  # noqa: E402
from serving import KEY, error_of, http, module_server  # noqa: E402

MAX_LEN = 256
MAX_TOKENS = 16
NUM_STREAMS = 32  # the target: concurrent streams while the weights are updated
# Fewer sequences a step than the streams run: calls queue, and one of two prompts may go into the engine
# a while before the other (admission is round robin), the split an update must never fall into.
MAX_NUM_SEQS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)  # (as every request here asks)
NUM_PROMPTS = 8
OPERATIONS = ["/update_weights_from_disk", "/reset_prefix_cache", "/sleep", "/wake_up"]
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(1, 400) for _ in range(_rng.randint(2, 20))] for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Two tiny checkpoints of the same shapes (hidden 64, 2 layers) and tokenizer, other random weights,
    and one of other shapes (intermediate_size 64): a folder no update may take."""
    return {"A": build_model(str(tmp_path_factory.mktemp("A")), seed=0, chat_template=True),
            "B": build_model(str(tmp_path_factory.mktemp("B")), seed=1),
            "other shapes": build_model(str(tmp_path_factory.mktemp("C")), seed=2, intermediate_size=64)}


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[str]]:
    """Each checkpoint's greedy completion of each prompt (LLM.generate, offline), by name."""
    texts = {}
    for name in ("A", "B"):
        with LLM(checkpoints[name], max_model_len=MAX_LEN) as llm:
            texts[name] = [out["text"] for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert all(a != b for a, b in zip(texts["A"], texts["B"])), "A and B must tell apart on every prompt"
    return texts


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    yield from module_server(checkpoints["A"], tmp_path_factory, "--api-key", KEY, "--max-num-seqs",
                             str(MAX_NUM_SEQS), max_model_len=MAX_LEN)


def completions(server) -> list[str]:
    """The server's greedy completion of every prompt, one call each."""
    texts = []
    for prompt in PROMPTS:
        response = http(server, "POST", "/v1/completions", json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    return texts


def update(server, path: str) -> dict:
    response = http(server, "POST", "/update_weights_from_disk", json={"model_path": path})
    assert response.status_code == 200, response.text
    return response.json()


# ---- the API key ---------------------------------------------------------------------------------
@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["no-key", "wrong-key"])
def test_every_operation_needs_the_api_key(server, checkpoints, key):
    for path in OPERATIONS:
        body = {"model_path": checkpoints["B"]} if path == "/update_weights_from_disk" else {}
        error = error_of(http(server, "POST", path, key=key, json=body), 401)
        assert error["code"] == "invalid_api_key"
    error_of(http(server, "GET", "/is_sleeping", key=key), 401)
    assert http(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}  # (nothing was run)


# ---- weight updates ------------------------------------------------------------------------------
def test_a_bad_checkpoint_is_a_400_and_the_old_weights_serve_on(server, checkpoints, expected, tmp_path):
    assert completions(server) == expected["A"]
    for path in (str(tmp_path / "missing"), str(tmp_path), checkpoints["other shapes"]):  # (tmp_path: empty)
        error = error_of(http(server, "POST", "/update_weights_from_disk", json={"model_path": path}), 400)
        assert error["param"] == "model_path" and error["type"] == "invalid_request_error", error
        assert completions(server) == expected["A"], path
    for body, param in (({}, "model_path"), ({"model_path": 5}, "model_path"),
                        ({"model_path": checkpoints["B"], "load_format": "auto"}, "load_format")):
        error = error_of(http(server, "POST", "/update_weights_from_disk", json=body), 400)
        assert error["param"] == param, error
    assert completions(server) == expected["A"]


def test_an_update_serves_the_new_weights_with_the_prefix_cache_reset(server, checkpoints, expected):
    assert completions(server) == expected["A"]  # (each prompt's blocks are cached now, under A)
    answer = update(server, checkpoints["B"])
    assert answer["success"] is True and answer["num_loaded"] > 0, answer
    assert completions(server) == expected["B"]  # (A's cached KV is not reused)
    reset = http(server, "POST", "/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json() == {"success": True}, reset.text
    assert completions(server) == expected["B"]
    error = error_of(http(server, "POST", "/reset_prefix_cache", json={"all": True}), 400)
    assert error["param"] == "all"
    update(server, checkpoints["A"])
    assert completions(server) == expected["A"]


# ---- sleep and wake-up ---------------------------------------------------------------------------
def test_asleep_a_completion_is_a_503_with_retry_after_until_wake_up(server, expected):
    answer = http(server, "POST", "/sleep")  # (no body: level 1)
    assert answer.status_code == 200 and answer.json() == {"success": True, "is_sleeping": True}, answer.text
    assert http(server, "GET", "/is_sleeping").json() == {"is_sleeping": True}
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    for stream in (False, True):
        refused = http(server, "POST", "/v1/completions", json={**body, "stream": stream})
        error = error_of(refused, 503)
        assert refused.headers["Retry-After"] == "1" and "asleep" in error["message"], refused.text
    refused = http(server, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert error_of(refused, 503) and refused.headers["Retry-After"] == "1"
    assert "asleep already" in error_of(http(server, "POST", "/sleep", json={"level": 1}), 400)["message"]
    for bad in ({"tags": ["bogus"]}, {"tags": []}, {"tags": "weights"}):
        assert error_of(http(server, "POST", "/wake_up", json=bad), 400)["param"] == "tags", bad
    assert httpx.get(server.url + "/health").status_code == 200  # (asleep is not failed)
    answer = http(server, "POST", "/wake_up", json={})
    assert answer.status_code == 200 and answer.json() == {"success": True, "is_sleeping": False}, answer.text
    assert completions(server) == expected["A"]
    answer = http(server, "POST", "/wake_up")  # awake: a no-op
    assert answer.status_code == 200 and answer.json()["is_sleeping"] is False


@pytest.mark.parametrize("level", [0, 3, True, 1.0, "1"])
def test_a_bad_sleep_level_is_a_400_naming_it(server, level):
    error = error_of(http(server, "POST", "/sleep", json={"level": level}), 400)
    assert error["param"] == "level", error
    assert http(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}


def test_level_2_wakes_up_with_the_checkpoint_s_weights(server, expected):
    assert http(server, "POST", "/sleep", json={"level": 2}).json()["is_sleeping"] is True
    assert http(server, "POST", "/wake_up").json()["is_sleeping"] is False
    assert completions(server) == expected["A"]


def test_sleep_wake_the_weights_update_then_wake_the_kv_cache(server, checkpoints, expected):
    """vLLM's RL loop: the weights back first, updated, and only then the KV cache (still asleep till then)."""
    assert http(server, "POST", "/sleep", json={"level": 1}).status_code == 200
    answer = http(server, "POST", "/wake_up", json={"tags": ["weights"]})
    assert answer.status_code == 200 and answer.json()["is_sleeping"] is True, answer.text
    update(server, checkpoints["B"])
    error_of(http(server, "POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2}), 503)
    assert http(server, "POST", "/wake_up", json={"tags": ["kv_cache"]}).json()["is_sleeping"] is False
    assert completions(server) == expected["B"]
    update(server, checkpoints["A"])
    assert completions(server) == expected["A"]


# ---- the engine thread's side (AsyncEngine in this process) ---------------------------------------
async def text_of(request) -> str:
    return "".join([update["text"] or "" async for _, update in updates([request])])


def test_a_sleep_lets_the_calls_queued_finish_and_refuses_later_ones(checkpoints, expected):
    engine = AsyncEngine(LLM(checkpoints["A"], max_model_len=MAX_LEN))

    async def main():
        queued = await engine.submit(PROMPTS[0], GREEDY)
        sleeping = asyncio.create_task(engine.sleep(1))
        await asyncio.sleep(0)  # (the sleep asked for: its task has run up to its wait)
        with pytest.raises(Asleep, match="going to sleep"):
            await engine.submit(PROMPTS[1], GREEDY)
        assert await text_of(queued) == expected["A"][0]  # (queued before the sleep: run, on the weights it had)
        await sleeping
        assert engine.asleep == 1
        with pytest.raises(Asleep, match="asleep"):
            await engine.submit(PROMPTS[1], GREEDY)
        await engine.wake_up(None)
        assert engine.asleep == 0
        return await text_of(await engine.submit(PROMPTS[1], GREEDY))
    try:
        assert asyncio.run(main()) == expected["A"][1]
    finally:
        engine.shutdown()


def refused(llm):
    raise ValueError("refused, nothing changed")


def broken(llm):
    raise RuntimeError("a worker died halfway through the update")


def test_an_operation_that_fails_midway_fails_the_engine_rather_than_serve_a_mix(checkpoints, expected):
    """A ValueError leaves the engine as it was, serving; any other failure may have left half the weights
    updated, so the engine stops (EngineDead) instead of serving a mix of two versions."""
    engine = AsyncEngine(LLM(checkpoints["A"], max_model_len=MAX_LEN))

    async def main():
        with pytest.raises(ValueError, match="refused"):
            await engine.operate(refused, PAUSE)
        assert await text_of(await engine.submit(PROMPTS[0], GREEDY)) == expected["A"][0]
        with pytest.raises(EngineDead, match="a worker died"):
            await engine.operate(broken, PAUSE)
        with pytest.raises(EngineDead):
            await engine.submit(PROMPTS[0], GREEDY)
    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


# ---- updates under load --------------------------------------------------------------------------
async def stream_completion(client: httpx.AsyncClient, prompts: list[list[int]]) -> tuple[int, list[str], list]:
    """One greedy streamed call of these prompts: its status, each choice's text, any error events."""
    body = {"prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    texts, errors = [""] * len(prompts), []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return response.status_code, [(await response.aread()).decode()], errors
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                errors.append(event["error"])
            for choice in event.get("choices", []):
                texts[choice["index"]] += choice["text"]
    return response.status_code, texts, errors


def test_32_streams_see_one_version_each_while_updates_alternate(server, checkpoints, expected):
    versions = ["B", "A", "B", "A"]  # (ending on A, as the server started)

    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        limits = httpx.Limits(max_connections=NUM_STREAMS + 4)
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60, limits=limits) as client:
            done = asyncio.Event()
            results = []  # (prompt indices, status, texts, error events)

            async def streams(worker: int):
                i = worker
                while True:  # (until the last update, and once more after it)
                    last = done.is_set()
                    # half the streams are calls of two prompts: both must see the same weights
                    indices = [i % NUM_PROMPTS] + ([(i + 1) % NUM_PROMPTS] if worker % 2 else [])
                    results.append((indices, *await stream_completion(client, [PROMPTS[p] for p in indices])))
                    i += NUM_STREAMS
                    if last:
                        return

            async def updates():
                answers = []
                for version in versions:
                    await asyncio.sleep(0.05)  # (streams under way in between)
                    answers.append(await client.post("/update_weights_from_disk",
                                                     json={"model_path": checkpoints[version]}))
                done.set()
                return answers

            workers = [asyncio.create_task(streams(w)) for w in range(NUM_STREAMS)]
            answers = await updates()
            await asyncio.gather(*workers)
            return answers, results

    answers, results = asyncio.run(run())
    assert [a.status_code for a in answers] == [200] * len(versions), [a.text for a in answers]
    assert all(status == 200 and not errors for _, status, _, errors in results), \
        [r for r in results if r[1] != 200 or r[3]][:3]
    seen = {"A": 0, "B": 0}
    for indices, _, texts, _ in results:
        version = next((v for v in ("A", "B") if texts == [expected[v][p] for p in indices]), None)
        assert version is not None, f"prompts {indices}: {texts!r} are neither all A's " \
            f"{[expected['A'][p] for p in indices]!r} nor all B's {[expected['B'][p] for p in indices]!r}"
        seen[version] += 1
    assert seen["A"] and seen["B"], seen  # (both versions served while the streams ran)
    assert completions(server) == expected["A"]
