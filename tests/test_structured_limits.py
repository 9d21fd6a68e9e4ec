"""Structured outputs under hostile input: the work one constraint may ask of a compile is bounded
before it is queued (size, JSON nesting); a request's time limit counts its own compile, not its
wait behind others'; a compile whose caller went away is dropped unstarted; shutdown ends every
wait for a compile at once; a grammar that accepts no text is refused when compiled, and one that
allowed_token_ids leaves no token ends that request alone (finish_reason "error"), never the engine
or another request. The server's side: each of these is a 4xx naming its field (or a 503 at
shutdown), and a required tool call's grammar is built off the event loop."""
import asyncio
import json
import threading
import time

import pytest

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the 'structured' extra)")

from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanovllm.features import structured_outputs  # noqa: E402
from nanovllm.features.structured_outputs import MAX_CONSTRAINT_CHARS, MAX_JSON_NESTING, grammar_threads  # noqa: E402
from nanovllm.entrypoints.async_engine import AsyncEngine, ShuttingDown  # noqa: E402

PROMPT = [5, 17, 33, 2, 9]


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, max_model_len=256) as llm:
        yield llm


def constrained(max_tokens=20, **kind) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**kind))


def nested(levels: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# ---- bounded work --------------------------------------------------------------------------
@pytest.mark.parametrize("kind, words", [
    ({"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, "structured_outputs.regex has 65,537 characters"),
    ({"choice": ["x" * 1000] * 66}, "structured_outputs.choice has 66,000 characters"),
    ({"grammar": 'root ::= "' + "a" * MAX_CONSTRAINT_CHARS + '"'}, "structured_outputs.grammar has"),
    ({"json": {"enum": [f"v{i}" for i in range(20_000)]}}, "structured_outputs.json has"),
    ({"json": nested(40)}, f"nests 81 levels deep, more than the {MAX_JSON_NESTING}"),
])
def test_a_constraint_beyond_the_bounds_is_refused_before_it_compiles(llm, kind, words, monkeypatch):
    compiles = []
    grammars = llm.grammar_compiler()
    monkeypatch.setattr(grammars, "_compile", lambda params: compiles.append(params))
    start = time.monotonic()
    with pytest.raises(ValueError, match=words):
        llm.generate([PROMPT], constrained(**kind), use_tqdm=False)
    assert not compiles and time.monotonic() - start < 5  # (a 100,000-value enum took 35 s to compile)


def test_a_schema_within_the_bounds_compiles(llm):
    out = llm.generate([PROMPT], constrained(json=nested(MAX_JSON_NESTING // 2 - 1), max_tokens=200),
                       use_tqdm=False)[0]
    assert out["finish_reason"] in ("stop", "length")


# ---- a grammar that accepts nothing ------------------------------------------------------------
@pytest.mark.parametrize("grammar", ["root ::= root", "root ::= [^\\x00-\\U0010FFFF]"])
def test_a_grammar_that_accepts_no_text_is_refused_when_compiled(llm, grammar):
    with pytest.raises(ValueError, match="accepts no text"):
        llm.generate([PROMPT], constrained(grammar=grammar), use_tqdm=False)


def test_allowed_token_ids_without_a_first_token_of_the_grammar_is_refused(llm):
    a = llm.tokenizer.convert_tokens_to_ids("a")
    params = SamplingParams(max_tokens=5, allowed_token_ids=[a], structured_outputs=StructuredOutputsParams(regex="b+"))
    with pytest.raises(ValueError, match="allowed_token_ids holds no token"):
        llm.generate([PROMPT], params, use_tqdm=False)


def test_a_row_with_no_token_left_ends_alone_with_finish_reason_error(llm):
    """regex "ab" with only "a" allowed: the first token passes, the second has none left. That
    request ends with "error"; the others in its batch are as they are alone."""
    a = llm.tokenizer.convert_tokens_to_ids("a")
    stuck = SamplingParams(max_tokens=5, allowed_token_ids=[a], structured_outputs=StructuredOutputsParams(regex="ab"))
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([PROMPT, [7, 8]], free, use_tqdm=False)
    outs = llm.generate([PROMPT, PROMPT, [7, 8]], [free, stuck, free], use_tqdm=False)
    assert outs[1]["finish_reason"] == "error" and outs[1]["token_ids"][0] == a
    assert [outs[0]["token_ids"], outs[2]["token_ids"]] == [o["token_ids"] for o in alone]
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]


# ---- the grammar threads: own time, dropped when unwanted, shut down ------------------------------
def occupy_the_grammar_threads(seconds: float) -> threading.Event:
    """Keep every grammar thread busy until the returned event is set (or seconds pass)."""
    release = threading.Event()
    for _ in range(structured_outputs.COMPILE_THREADS):
        grammar_threads().submit(release.wait, seconds)
    return release


def test_the_time_limit_counts_a_compile_of_its_own_not_its_wait(llm, monkeypatch):
    """A compile queued behind slow ones waits longer than the limit and still succeeds; one that
    itself runs past it fails."""
    grammars = llm.grammar_compiler()
    monkeypatch.setattr(grammars, "timeout_s", 0.5)
    release = occupy_the_grammar_threads(30)
    timer = threading.Timer(1.5, release.set)
    timer.start()
    start = time.monotonic()
    out = llm.generate([PROMPT], constrained(regex="(yes|no)"), use_tqdm=False)[0]
    assert time.monotonic() - start >= 1.4 and out["finish_reason"] == "stop"
    compile_ = grammars._compile
    monkeypatch.setattr(grammars, "_compile", lambda params: (time.sleep(1.5), compile_(params))[1])
    with pytest.raises(ValueError, match="took over 0.5 s"):
        llm.generate([PROMPT], constrained(regex="(maybe|never)"), use_tqdm=False)


def test_a_compile_whose_caller_went_away_is_dropped_unstarted(llm, monkeypatch):
    engine = AsyncEngine(llm)
    grammars = llm.grammar_compiler()
    compiled = []
    compile_ = grammars._compile
    monkeypatch.setattr(grammars, "_compile", lambda params: (compiled.append(params), compile_(params))[1])

    async def main():
        release = occupy_the_grammar_threads(30)
        waits = [asyncio.create_task(engine.compile_grammar(constrained(regex=f"left{i}"))) for i in range(20)]
        await asyncio.sleep(0.3)
        for wait in waits:  # (their clients disconnected: the server cancels what they await)
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        release.set()
        await engine.compile_grammar(constrained(regex="fresh"))  # (at once: nothing left in the queue before it)
    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        engine.shutdown()
    assert [p.regex for p in compiled] == ["fresh"]


def test_close_ends_every_wait_for_a_compile_at_once(llm):
    engine = AsyncEngine(llm)

    async def main():
        release = occupy_the_grammar_threads(30)
        waits = [asyncio.create_task(engine.compile_grammar(constrained(regex=f"wait{i}"))) for i in range(4)]
        await asyncio.sleep(0.3)
        start = time.monotonic()
        engine.close()
        results = await asyncio.gather(*waits, return_exceptions=True)
        release.set()
        return time.monotonic() - start, results
    try:
        seconds, results = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(isinstance(r, ShuttingDown) for r in results), results
    assert seconds < 2  # (POLL_S is 0.1 s; the compiles themselves are still queued behind 30 s jobs)


# ---- the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from serving import chat_server
    yield from chat_server(tmp_path_factory, "limits")


def post(server, path, body):
    from serving import http
    return http(server, "POST", path, json=body)


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "hi", "structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs", "accepts no text"),
    ({"prompt": "hi", "structured_outputs": {"choice": ["x" * 70_000]}}, "structured_outputs", "70,000 characters"),
    ({"prompt": "hi", "structured_outputs": {"json": {"enum": [f"v{i}" for i in range(100_000)]}}},
     "structured_outputs", "more than the 65,536"),
    ({"prompt": "hi", "allowed_token_ids": [0], "structured_outputs": {"regex": "a+"}}, "allowed_token_ids",
     "holds no token"),
    ({"messages": CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": nested(400)}}]}, "tools",
     "tools.0.function.parameters nests 801 levels deep"),
])
def test_the_servers_refusals_name_their_field(server, body, param, words):
    from serving import error_of
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    start = time.monotonic()
    error = error_of(post(server, path, body), 400)
    assert error["param"] == param and words in error["message"], error
    assert time.monotonic() - start < 10  # (the deep tool schema froze the server 28.6 s; the enum took 35 s)


def test_a_row_with_no_token_left_is_that_requests_400_not_a_503(server):
    """Not "the server is shutting down" (what finish_reason "abort" means): the request's own
    constraints, named; streamed, an error event and then [DONE]."""
    from nanovllm.utils.tiny_model import build_tokenizer
    from serving import error_of
    a = build_tokenizer(str(server.log_path.parent / "tokenizer")).convert_tokens_to_ids("a")
    body = {"prompt": "hi", "max_tokens": 5, "allowed_token_ids": [a], "structured_outputs": {"regex": "ab"}}
    error = error_of(post(server, "/v1/completions", body), 400)
    assert error["param"] == "allowed_token_ids" and "none in common" in error["message"], error
    streamed = post(server, "/v1/completions", {**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == 400 and streamed.text.endswith("data: [DONE]\n\n")
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_required_tool_calls_grammar_is_built_off_the_event_loop_and_timed(llm, monkeypatch):
    """xgrammar took 28.6 s over a deep tool schema, on the event loop: every stream stalled."""
    from nanovllm.entrypoints.api_server import sampling_params
    from nanovllm.entrypoints.protocol import BadRequest, ChatCompletionRequest
    from nanovllm.entrypoints.tool_parsers import HermesToolParser
    body = ChatCompletionRequest.model_validate({"messages": CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    parser = HermesToolParser()
    body.use_parsers(parser)
    monkeypatch.setattr(parser, "grammar", lambda tools, parallel: (time.sleep(1.5), 'root ::= "x"')[1])
    engine = AsyncEngine(llm)
    engine.grammar_timeout_s = 0.5

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        ticker = asyncio.create_task(tick())
        with pytest.raises(BadRequest, match="tools: building the grammar of their calls took over 0.5 s") as refused:
            await sampling_params(engine, body, None)
        ticker.cancel()
        return ticks, refused.value.param
    try:
        ticks, param = asyncio.run(main())
    finally:
        engine.shutdown()
    assert param == "tools" and ticks >= 10  # (the loop ran on while the grammar was built)


SLOW_REGEX_WORDS = 4000  # alternatives in each regex: ~3 s of compiling each here, within the size bound


def test_sigterm_during_slow_compiles_answers_503s_and_exits_without_waiting_for_the_queue(tmp_path):
    """Those clients got a plain-text 500 at 5.3 s and the process exited after 66.7 s: now each
    gets its 503 at once, and the exit waits only for the two compiles running (xgrammar cannot
    stop one), not for the 14 queued (~20 s more of compiling)."""
    import random
    import subprocess

    import httpx

    from nanovllm.utils.tiny_model import build_model
    from serving import Server
    server = Server(build_model(str(tmp_path / "model")), tmp_path / "server.log", max_model_len=128)
    rng = random.Random(0)
    regexes = ["(" + "|".join("".join(rng.choice("abcdefghij") for _ in range(12)) for _ in range(SLOW_REGEX_WORDS))
               + f")+{i}" for i in range(16)]
    assert all(len(r) < MAX_CONSTRAINT_CHARS for r in regexes)
    results = []

    def call(regex):
        body = {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": regex}}
        try:
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            results.append((response.status_code, response.headers.get("content-type", "")))
        except httpx.HTTPError as e:
            results.append((type(e).__name__, ""))
    try:
        clients = [threading.Thread(target=call, args=(r,)) for r in regexes]
        for client in clients:
            client.start()
        time.sleep(1.0)  # (two compiling, the rest queued)
        start = time.monotonic()
        server.proc.send_signal(subprocess.signal.SIGTERM)
        for client in clients:
            client.join(30)
        assert server.proc.wait(30) == 0, server.log()
        seconds = time.monotonic() - start
    finally:
        server.stop()
    print(f"SIGTERM with {len(regexes)} slow compiles in flight: exit in {seconds:.1f} s; {results}")
    assert results == [(503, "application/json")] * len(regexes), results
    assert seconds < 15 and "Traceback" not in server.log() and "terminate called" not in server.log()


def test_compiles_whose_clients_left_are_dropped_and_blame_nobody(server):
    """After 200 enum requests that disconnected at once, a fresh one waited 47 s; after two slow
    ones, trivial schemas got "compiling it took over 10 s" for 145 s. Now a client that leaves
    takes its queued compile with it, and a request's limit counts only its own compile."""
    import random

    import httpx
    rng = random.Random(1)
    regexes = ["(" + "|".join("".join(rng.choice("abcdefghij") for _ in range(12)) for _ in range(SLOW_REGEX_WORDS))
               + f")+{i}" for i in range(24)]

    def leave(regex):  # (the client gives up after 0.5 s)
        try:
            httpx.post(server.url + "/v1/completions", timeout=0.5, headers={"Authorization": "Bearer test-key"},
                       json={"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": regex}})
        except httpx.TimeoutException:
            pass
    leavers = [threading.Thread(target=leave, args=(r,)) for r in regexes]
    for thread in leavers:
        thread.start()
    for thread in leavers:
        thread.join()
    start = time.monotonic()
    fresh = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 20, "structured_outputs": {
        "json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}})
    seconds = time.monotonic() - start
    print(f"a fresh schema behind {len(regexes)} compiles whose clients left: {seconds:.1f} s")
    assert fresh.status_code == 200, fresh.text
    assert seconds < 15  # (the two compiles already running finish, ~3 s each here; the 22 queued, ~33 s, are dropped)
