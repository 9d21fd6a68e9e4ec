"""Data parallelism (distributed/data_parallel.py, router.py): replicas of the whole engine, each a
process, behind one front. The router's choices; a served model whose answers are LLM.generate's
whichever replica ran them; a replica killed mid-stream fails only its own requests (503);
scripts/bench_dp_routing.py's comparison of the routings."""
import asyncio
import json
import os
import random
import re
import signal
import sys

import pytest

from nanovllm.distributed.router import PrefixRouter, RoundRobinRouter, block_hashes, make_router
from test_tensor_parallel import alive as running  # (exists and is not a zombie)

BS = 4


def prompt(prefix: int, length: int, tail: int = 0) -> list[int]:
    """`length` tokens, the first all from prefix group `prefix`, then `tail` distinct ones."""
    rng = random.Random(prefix)
    return [rng.randrange(1000) for _ in range(length)] + list(range(5000 + tail, 5000 + tail + 3))


def test_block_hashes_cover_the_full_blocks_before_the_last_token():
    assert len(block_hashes(list(range(8)), BS)) == 1  # (the last token's block is computed, never cached)
    assert len(block_hashes(list(range(9)), BS)) == 2
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BS), block_hashes([1, 2, 3, 4, 0, 6, 7, 8, 9], BS)
    assert a[0] == b[0] and a[1] != b[1]  # chained: a block's hash names its whole prefix


def test_prefix_router_sends_a_shared_prefix_where_it_went_before():
    router = PrefixRouter(3, BS, capacity=[100] * 3, slack=8)
    loads = [0, 0, 0]
    homes = {}
    for group in range(3):  # the first of each group: the least loaded replica, as nothing matches
        homes[group] = router.choose(prompt(group, 32), loads)
        loads[homes[group]] += 1
    assert sorted(homes.values()) == [0, 1, 2]
    for tail in range(4):  # the next of each group: where its prefix went, though another is as loaded
        for group in range(3):
            i = router.choose(prompt(group, 32, tail), loads)
            assert i == homes[group]
            loads[i] += 1


def test_prefix_router_sends_a_new_prefix_to_the_replica_holding_the_fewest_blocks():
    router = PrefixRouter(2, BS, capacity=[100, 100], slack=100)
    assert router.choose(prompt(0, 64), [0, 0]) == 0  # 16 blocks sent there
    assert router.choose(prompt(1, 32), [0, 0]) == 1  # 8 here: though both are as loaded
    assert router.choose(prompt(2, 32), [0, 0]) == 1  # 16 here now too
    assert router.choose(prompt(3, 32), [0, 5]) == 0  # as many: the less loaded


def test_prefix_router_sends_a_new_prefix_to_the_fewest_blocks_even_if_another_is_less_loaded():
    """The fewest blocks sent decides an unmatched prompt, the load only a tie (the less loaded
    replica, with more blocks, is passed over while it is within the slack)."""
    router = PrefixRouter(2, BS, capacity=[100, 100], slack=8)
    assert router.choose(prompt(0, 64), [0, 0]) == 0  # 16 blocks there
    assert router.choose(prompt(1, 32), [0, 0]) == 1  # 8 here
    assert router.choose(prompt(2, 16), [0, 3]) == 1  # the fewest blocks (8 < 16), though the more loaded
    assert router.choose(prompt(3, 16), [5, 0]) == 1  # 12 < 16 still; with 16 each now,
    assert router.choose(prompt(4, 16), [3, 2]) == 1  # a tie: the less loaded


def test_prefix_router_prefers_the_longest_match_then_the_less_loaded():
    """Of two replicas holding a prompt's leading blocks, the one holding more of them, though more
    loaded (within the slack); as many each: the less loaded, not the lower index."""
    router = PrefixRouter(2, BS, capacity=[100, 100], slack=8)
    long = prompt(0, 32)
    router.remember(0, block_hashes(long[:8] + [1], BS))  # its first 2 blocks on replica 0
    router.remember(1, block_hashes(long, BS))  # all 8 on replica 1
    assert router.choose(long + [7], [0, 4]) == 1
    router.remember(0, block_hashes(long, BS))  # 8 on each now
    assert router.choose(long + [8], [3, 1]) == 1
    assert router.choose(long + [9], [1, 3]) == 0


def test_prefix_router_leaves_a_replica_loaded_past_the_slack():
    router = PrefixRouter(2, BS, capacity=[100, 100], slack=2)
    home = router.choose(prompt(0, 32), [0, 0])
    loads = [0, 0]
    loads[home] = 3  # more than slack above the other: the prefix's home is passed over
    assert router.choose(prompt(0, 32, 1), loads) != home
    router = PrefixRouter(2, BS, capacity=[100, 100], slack=2)
    home = router.choose(prompt(0, 32), [0, 0])
    loads[home], loads[1 - home] = 2, 0  # at slack above: still its home
    assert router.choose(prompt(0, 32, 2), loads) == home


def test_prefix_router_forgets_the_least_recently_sent_blocks_past_a_replicas_capacity():
    router = PrefixRouter(2, BS, capacity=[8, 8], slack=100)
    assert router.choose(prompt(0, 32), [0, 0]) == 0  # 8 blocks: replica 0 full
    assert router.choose(prompt(1, 32), [1, 0]) == 1
    router.remember(0, block_hashes(prompt(2, 32), BS))  # 8 more sent to 0: group 0's are forgotten
    assert router.matched(0, block_hashes(prompt(0, 32), BS)) == 0
    assert router.choose(prompt(0, 32, 1), [0, 0]) == 0  # (a tie again: the lower index)
    assert router.choose(prompt(1, 32, 1), [5, 5]) == 1


def test_routers_never_choose_a_dead_replica():
    prefix = PrefixRouter(3, BS, capacity=[100] * 3, slack=8)
    home = prefix.choose(prompt(0, 32), [0, 0, 0])
    loads = [0, 0, 0]
    loads[home] = None
    assert prefix.choose(prompt(0, 32, 1), loads) not in (home, None)
    rr = RoundRobinRouter()
    assert [rr.choose([1, 2], [0, None, 0]) for _ in range(4)] == [0, 2, 0, 2]
    with pytest.raises(RuntimeError, match="no data-parallel replica"):
        rr.choose([1], [None, None])
    with pytest.raises(ValueError, match="round_robin"):
        make_router("random", 2, BS, [10, 10], 4)


# ---- served: `nanovllm serve MODEL --data-parallel-size 2` ---------------------------------------
def replica_pids(server) -> list[int]:
    found = re.search(r"Data parallelism: \d+ replicas \(pids ([\d, ]+)\)", server.log())
    assert found, server.log()
    return [int(pid) for pid in found.group(1).split(", ")]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from nanovllm.utils.tiny_model import build_model
    return build_model(str(tmp_path_factory.mktemp("dp")))


def served_metrics(server, condition, timeout: float = 30.0) -> dict:
    """The server's metrics once condition(metrics) holds (a replica's stats reach the front after its step)."""
    from serving import wait_for
    seen = {}

    def check():
        seen.update(server.metrics())
        return condition(seen)
    assert wait_for(check, timeout), seen
    return seen


def test_replicas_answer_as_llm_generate_spread_a_call_and_keep_a_prefix_on_one(model, tmp_path):
    pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
    openai = pytest.importorskip("openai", reason="the openai client is not installed")
    from serving import Server
    from nanovllm import LLM, SamplingParams
    prompts = [[10 + i] + [7, 8, 9] * 10 for i in range(4)]  # (no block in common)
    with LLM(model, max_model_len=512) as llm:
        expected = [o["text"] for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                                          ignore_eos=True), use_tqdm=False)]
    server = Server(model, tmp_path / "server.log", "--data-parallel-size", "2", max_model_len=512)
    pids = replica_pids(server)
    try:
        assert len(pids) == 2 and all(running(pid) for pid in pids)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        out = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
        routed = ['nanovllm:replica_requests_total{replica="0"}', 'nanovllm:replica_requests_total{replica="1"}']
        before = served_metrics(server, lambda m: all(key in m for key in routed))
        assert [before[key] for key in routed] == [2, 2]  # one call's prompts, spread by load

        shared = [3, 1, 4, 1, 5, 9, 2, 6] * 8  # 4 full blocks, then a token of each request's own
        for tail in range(3):
            client.completions.create(model=model, prompt=shared + [100 + tail], max_tokens=2, temperature=0)
        after = served_metrics(server, lambda m: m["nanovllm:prefix_cache_hit_tokens_total"] >= 128)
        grew = [after[key] - before[key] for key in routed]
        assert sorted(grew) == [0, 3], grew  # all three where the first went
        home = grew.index(3)
        assert after[f'nanovllm:replica_prefix_cache_hit_tokens{{replica="{home}"}}'] == 128  # (2 x 4 blocks)
        assert after['nanovllm:replica_up{replica="0"}'] == after['nanovllm:replica_up{replica="1"}'] == 1
    finally:
        assert server.stop() == 0, server.log()
    assert not [pid for pid in pids if running(pid)], "a replica outlived the server"


def test_a_killed_replica_fails_its_own_stream_with_a_503_and_the_others_go_on(model, tmp_path):
    pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
    import httpx
    from serving import Server
    server = Server(model, tmp_path / "server.log", "--data-parallel-size", "2", max_model_len=1024)
    pids = replica_pids(server)

    def body(first: int) -> dict:
        return {"model": model, "prompt": [first] * 8, "max_tokens": 1000, "stream": True, "ignore_eos": True,
                "temperature": 0}

    def events(lines) -> list:
        return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    try:
        url = server.url + "/v1/completions"
        with httpx.stream("POST", url, json=body(11), timeout=120) as a:  # replica 0 (both idle: the lower index)
            lines_a = a.iter_lines()
            assert next(lines_a).startswith("data: {")
            with httpx.stream("POST", url, json=body(12), timeout=120) as b:  # replica 1 (the less loaded)
                lines_b = b.iter_lines()
                assert next(lines_b).startswith("data: {")
                os.kill(pids[1], signal.SIGKILL)
                rest_b = list(lines_b)
            assert rest_b[-1] == "data: [DONE]" or rest_b[-2:] == ["data: [DONE]", ""], rest_b[-3:]
            error = events(rest_b)[-1]["error"]
            assert error["code"] == 503 and "replica 1 died" in error["message"], error
            finals = [e for e in events(lines_a) if e["choices"][0]["finish_reason"] is not None]
        assert [e["choices"][0]["finish_reason"] for e in finals] == ["length"]  # replica 0's ran to its end
        again = httpx.post(url, json={**body(13), "stream": False, "max_tokens": 4}, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(server.url + "/health").status_code == 200
        up = served_metrics(server, lambda m: m.get('nanovllm:replica_up{replica="1"}') == 0)
        assert up['nanovllm:replica_up{replica="0"}'] == 1
        assert "data-parallel replica 1 died" in server.log()
        os.kill(pids[0], signal.SIGKILL)  # the last one: now the server cannot serve
        from serving import wait_for
        assert wait_for(lambda: httpx.get(server.url + "/health").status_code == 503)
        refused = httpx.post(url, json={**body(14), "stream": False, "max_tokens": 4}, timeout=60)
        assert refused.status_code == 503 and "every data-parallel replica has died" in refused.text
    finally:
        assert server.stop() == 0, server.log()


def test_each_replica_gets_the_next_gpus(monkeypatch):
    from nanovllm.distributed.data_parallel import replica_gpus
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7,9")
    assert replica_gpus(2, 2) == ["3,5", "6,7"]
    assert replica_gpus(5, 1) == ["3", "5", "6", "7", "9"]
    with pytest.raises(ValueError, match="data_parallel_size=3 replicas of 2 GPU"):
        replica_gpus(3, 2)


def test_the_front_counts_samples_caps_the_queue_and_aborts_on_the_replicas(model):
    """n samples each end once; --max-queued-requests counts what was sent and is not running (at
    most max_num_seqs=1 a replica runs); an abort (a client gone: no last update, as AsyncEngine's)
    leaves the front's load at once, and the replicas end the requests."""
    import asyncio
    from serving import wait_for
    from nanovllm import SamplingParams
    from nanovllm.distributed.data_parallel import DataParallelEngine
    from nanovllm.entrypoints.async_engine import QueueFull, updates
    engine = DataParallelEngine(model, {"device": "cpu", "max_model_len": 1024, "max_num_seqs": 1}, 2,
                                max_queued_requests=4)

    async def scenario():
        sampled = engine.submit_all([[1, 2, 3]], [SamplingParams(n=3, max_tokens=4, seed=1)])
        assert sorted(u["sample"] for _, u in [x async for x in updates(sampled)] if u["finished"]) == [0, 1, 2]
        long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        accepted = []
        with pytest.raises(QueueFull, match="4 sequences may wait"):
            for i in range(8):
                accepted += engine.submit_all([[10 + i] * 8], [long])
        assert 4 <= len(accepted) <= 6  # (4 waiting, and up to one running on each replica)
        for request in accepted:
            engine.abort(request)
        assert [r.load for r in engine.replicas] == [0, 0] and not engine._where
    try:
        asyncio.run(scenario())
        assert wait_for(lambda: all(r.stats.get("num_running", 0) == r.stats.get("num_waiting", 0) == 0
                                    for r in engine.replicas),
                        timeout=60)
    finally:
        engine.shutdown()


# ---- the front over replicas the test plays (their ends of the pipes, no processes) ---------------
class PlayedProcess:
    """A played replica's process: exiting closes the replica's end of its pipe; joining it exits it."""
    pid, exitcode = 0, 0

    def __init__(self, end):
        import threading
        self.end = end
        self._closing = threading.Lock()  # the test and the front's reader thread may both close the end

    def exit(self):
        with self._closing:
            if not self.end.closed:
                self.end.close()

    def join(self, timeout=None):
        self.exit()

    def is_alive(self) -> bool:
        return False

    def kill(self):
        pass


@pytest.fixture
def played(model, monkeypatch):
    """played(size=2, max_num_seqs=8, **DataParallelEngine's options) -> (the front, each replica's end of
    its pipe): the front as it runs (its router, its reader threads), over replicas the test plays: it
    reads what the front sends them (commands()) and sends what a replica would."""
    import multiprocessing
    from nanovllm.distributed import data_parallel
    engines = []

    def make(size: int = 2, max_num_seqs: int = 8, **kwargs):
        ends = []

        def start(model, options, size, config):
            handles = []
            for i in range(size):
                front, end = multiprocessing.Pipe()
                ends.append(end)
                handle = data_parallel.ReplicaHandle(i, PlayedProcess(end), front)
                handle.info = {"num_blocks": 100, "block_size": BS, "max_num_seqs": max_num_seqs}
                handles.append(handle)
            return handles
        monkeypatch.setattr(data_parallel.DataParallelEngine, "_start", staticmethod(start))
        engines.append(data_parallel.DataParallelEngine(model, {"device": "cpu", "max_model_len": 1024}, size,
                                                        **kwargs))
        return engines[-1], ends
    yield make
    for engine in engines:
        engine.shutdown()


def commands(end) -> list[tuple]:
    """What the front has sent this replica since last asked (it sends before submit_all or abort returns)."""
    sent = []
    while end.poll(0):
        sent.append(end.recv())
    return sent


def added(ends) -> list[list[int]]:
    """Each replica's keys of the prompts the front has sent it since last asked (other commands dropped)."""
    return [[key for c in commands(end) if c[0] == "add" for key in c[1]] for end in ends]


def replica_stats(**given) -> dict:
    """A replica's stats snapshot (AsyncEngine.stats' keys): zeros but for `given`."""
    stats = dict.fromkeys(("num_running", "num_waiting", "num_cached_tokens", "num_preemptions", "spec_num_drafts",
                           "spec_num_draft_tokens", "spec_num_accepted_tokens", "prefix_cache_queries",
                           "host_cache_queries", "host_cache_hits", "kv_offloaded_bytes", "kv_reloaded_bytes",
                           "num_host_blocks", "num_host_blocks_used"), 0)
    return stats | {"kv_cache_usage": 0.0, "kv_copy_time_s": 0.0, "spec_num_accepted_tokens_per_pos": []} | given


def test_the_fronts_waiting_count_leaves_out_what_its_replicas_run(played):
    """--max-queued-requests counts the sequences sent and not running: once each replica's snapshot
    says it runs the one it was sent, two more may wait, and no third."""
    from serving import wait_for
    from nanovllm import SamplingParams
    from nanovllm.entrypoints.async_engine import QueueFull
    engine, ends = played(max_queued_requests=2)
    params = SamplingParams(max_tokens=4)

    async def scenario():
        for i in range(2):
            engine.submit_all([[10 + i] * 8], [params])
        assert added(ends) == [[0], [1]]  # (no block in common: the replica holding fewer blocks)
        with pytest.raises(QueueFull, match="2 sequences may wait .* 2 are waiting already"):
            engine.submit_all([[20] * 8], [params])
        for end in ends:
            end.send([("stats", replica_stats(num_running=1, kv_cache_usage=0.1))])
        assert wait_for(lambda: engine.stats["num_running"] == 2, timeout=10)
        for i in range(2):
            engine.submit_all([[30 + i] * 8], [params])
        assert added(ends) == [[2], [3]]
        with pytest.raises(QueueFull, match="2 are waiting already"):
            engine.submit_all([[40] * 8], [params])
        assert added(ends) == [[], []]  # (a refused call sends nothing)
    asyncio.run(scenario())


def test_the_fronts_queue_limit_counts_each_prompt_n_times(played):
    """--max-queued-requests 4: one prompt with n=5 could never be queued (TooLarge); n=3, then n=2
    would be 5 waiting (QueueFull), n=1 fills the limit; each refused call reaches no replica."""
    from nanovllm import SamplingParams
    from nanovllm.entrypoints.async_engine import QueueFull, TooLarge
    engine, ends = played(max_queued_requests=4)

    async def scenario():
        with pytest.raises(TooLarge, match="5 sequences"):
            engine.submit_all([[1] * 8], [SamplingParams(n=5, seed=0)])
        engine.submit_all([[1] * 8], [SamplingParams(n=3, seed=0)])
        with pytest.raises(QueueFull, match="3 are waiting already"):
            engine.submit_all([[2] * 8], [SamplingParams(n=2, seed=0)])
        with pytest.raises(TooLarge, match=r"5 sequences \(2 prompt"):
            engine.submit_all([[2] * 8, [3] * 8], [SamplingParams(n=2, seed=0), SamplingParams(n=3, seed=0)])
        engine.submit_all([[2] * 8], [SamplingParams()])
        with pytest.raises(QueueFull, match="4 are waiting already"):
            engine.submit_all([[3] * 8], [SamplingParams()])
        assert sorted(sum(added(ends), [])) == [0, 1]
    asyncio.run(scenario())


def test_an_abort_takes_all_the_samples_left_off_the_replicas_load(played):
    """An n=4 request aborted before any sample ends leaves all 4 off the load (4 more may wait); one
    aborted after a sample ended, the 3 left; either way its replica is told to end it."""
    from nanovllm import SamplingParams
    from nanovllm.entrypoints.async_engine import QueueFull, updates
    engine, ends = played(max_queued_requests=4)
    four = SamplingParams(n=4, seed=0)

    async def scenario():
        [request] = engine.submit_all([[1] * 8], [four])
        engine.abort(request)
        assert [c[0] for c in commands(ends[0])] == ["add", "abort"]
        [request] = engine.submit_all([[1] * 8], [four])  # (4 may wait again; its prefix is on replica 0)
        [(kind, [key], *_)] = commands(ends[0])
        ends[0].send([("update", key, {"sample": 2, "token_ids": [5], "text": "", "finished": True,
                                       "finish_reason": "length"})])
        stream = updates([request]).__aiter__()
        assert (await asyncio.wait_for(stream.__anext__(), 30))[1]["sample"] == 2  # 3 samples left
        engine.abort(request)
        assert commands(ends[0]) == [("abort", key)]
        engine.submit_all([[1] * 8], [four])  # (the 3 left it: 4 may wait again)
        with pytest.raises(QueueFull, match="4 are waiting already"):
            engine.submit_all([[1] * 8], [SamplingParams()])
        engine.abort(request)  # (again: nothing is left of it, and nothing is sent)
        assert [c[0] for c in commands(ends[0])] == ["add"]
    asyncio.run(scenario())


def test_a_calls_later_prompts_are_routed_with_the_load_of_its_earlier_ones(played):
    """One call of 4 prompts sharing 8 blocks, max_num_seqs 1 (the slack): the first two go where the
    prefix went, the third passes that replica over (2 above the other), the fourth joins it (as many
    blocks each: the less loaded). A call routed on the loads before it would pile all 4 on one."""
    from nanovllm import SamplingParams
    engine, ends = played(max_num_seqs=1)
    shared = [3, 1, 4, 1, 5, 9, 2, 6] * 4

    async def scenario():
        engine.submit_all([shared + [100 + i] for i in range(4)], [SamplingParams()] * 4)
        assert added(ends) == [[0, 1], [2, 3]]
    asyncio.run(scenario())


def test_a_replicas_error_fails_the_call_as_its_kind_says_and_frees_all_its_samples(played):
    """A replica's error for an n=3 request (--max-queued-requests 3: the next n=3 is admitted only
    once all 3 have left the load): EngineDead and ShuttingDown there are ReplicaFailed here (a 503),
    any other a RuntimeError (a 500)."""
    from nanovllm import SamplingParams
    from nanovllm.distributed.data_parallel import ReplicaFailed
    from nanovllm.entrypoints.async_engine import updates
    engine, ends = played(max_queued_requests=3)

    async def scenario():
        for kind, raised in (("EngineDead", ReplicaFailed), ("ShuttingDown", ReplicaFailed),
                             ("ValueError", RuntimeError)):
            [request] = engine.submit_all([[1] * 8], [SamplingParams(n=3, seed=0)])
            [[key], []] = added(ends)
            ends[0].send([("error", key, kind, "it broke"), ("stats", replica_stats())])  # (and its pass's snapshot)
            with pytest.raises(raised, match=f"replica 0: {kind}: it broke"):
                await asyncio.wait_for(updates([request]).__anext__(), 30)
    asyncio.run(scenario())


def test_the_fronts_metrics_keep_a_dead_replicas_counts_but_not_its_gauges(played):
    """/metrics of two replicas' snapshots: their sums (KV usage: their mean); once replica 1 has died,
    the running sequences and KV usage are replica 0's alone, the cumulative counts still both's."""
    pytest.importorskip("prometheus_client", reason="prometheus-client is not installed")
    from serving import wait_for
    from nanovllm.entrypoints.metrics import ServingMetrics
    metrics = ServingMetrics()
    engine, ends = played(metrics=metrics)

    def metric(name: str, replica: str | None = None) -> float | None:
        return metrics.registry.get_sample_value(f"nanovllm:{name}", None if replica is None else {"replica": replica})
    ends[0].send([("stats", replica_stats(num_running=2, kv_cache_usage=0.5, num_cached_tokens=10))])
    ends[1].send([("stats", replica_stats(num_running=3, kv_cache_usage=0.25, num_cached_tokens=7))])
    assert wait_for(lambda: metric("num_requests_running") == 5, timeout=10)
    assert metric("kv_cache_usage_perc") == 0.375 and metric("prefix_cache_hit_tokens_total") == 17
    engine.replicas[1].process.exit()  # replica 1 dies
    assert wait_for(lambda: metric("replica_up", "1") == 0, timeout=10)
    assert (metric("num_requests_running"), metric("kv_cache_usage_perc"), metric("prefix_cache_hit_tokens_total"),
            metric("replica_num_requests_running", "1"), metric("replica_up", "0")) == (2, 0.5, 17, 0, 1)


def test_a_replica_ends_an_aborted_calls_relay(model):
    """In the replica (here in this process, over a pipe): a call aborted mid-run, or before its task
    submitted it, ends its relay task and leaves nothing behind (AsyncEngine sends it no last update)."""
    import asyncio
    import multiprocessing
    import threading
    from serving import wait_for
    from nanovllm import LLM, SamplingParams
    from nanovllm.distributed.data_parallel import Replica
    front, end = multiprocessing.Pipe()
    replica = Replica(end, LLM(model, device="cpu", max_model_len=1024))
    thread = threading.Thread(target=lambda: asyncio.run(replica.serve()), daemon=True)
    thread.start()
    assert front.recv()[0] == "ready"
    long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    front.send(("add", [1, 2], [[5] * 8, [6] * 8], [long, long], True))
    assert front.recv()  # (a first batch: the call runs)
    front.send(("abort", 1))
    front.send(("add", [3], [[7] * 8], [long], False))
    front.send(("abort", 3))  # (before its task has run: remembered)
    front.send(("abort", 2))
    assert wait_for(lambda: not replica.calls and not replica.requests and not replica.aborted)
    front.send(("stop",))
    thread.join(30)
    assert not thread.is_alive()


def test_a_replica_keeps_an_abort_that_came_before_its_request(model):
    """An abort the replica gets before it has submitted the request (here: before the request's
    own command, the one order no race can change) ends the request when it comes: the front gets no
    update of it, though it streams; a later request runs and ends as usual."""
    import multiprocessing
    import threading
    from serving import wait_for
    from nanovllm import LLM, SamplingParams
    from nanovllm.distributed.data_parallel import Replica
    front, end = multiprocessing.Pipe()
    replica = Replica(end, LLM(model, device="cpu", max_model_len=1024))
    thread = threading.Thread(target=lambda: asyncio.run(replica.serve()), daemon=True)
    thread.start()
    try:
        assert front.recv()[0] == "ready"
        front.send(("abort", 3))
        front.send(("add", [3], [[7] * 8], [SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)], True))
        front.send(("add", [4], [[8] * 8], [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)], False))
        while True:  # (each batch: a pass of the replica's loop; key 3 would stream from its first step)
            assert front.poll(60), "the later request never finished"
            items = [item for item in front.recv() if item[0] in ("update", "error")]
            assert all(key == 4 for _, key, *_ in items), items
            if any(item[0] == "update" and item[2]["finished"] for item in items):
                break
        assert wait_for(lambda: not replica.calls and not replica.requests and not replica.aborted)
    finally:
        front.send(("stop",))
        thread.join(30)
    assert not thread.is_alive()


def test_bench_dp_routing_runs_both_routings_and_reports_the_ratio(model):
    """scripts/bench_dp_routing.py on a small draw (README's figures come from its default one): both
    servers answer every request, and the ratio is the two runs' cached prompt tokens."""
    pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_dp_routing
    result = bench_dp_routing.main(["--model", model, "--num-requests", "8", "--request-rate", "20",
                                    "--shared-prefix-groups", "2", "--shared-prefix-len", "64", "--input-len", "8",
                                    "--output-len", "2", "--num-kvcache-blocks", "64", "--max-model-len", "256",
                                    "--seeds", "0", "--json"])
    [run] = result["runs"]
    cached = run["cached_prompt_tokens"]
    assert run["failed"] == {"round_robin": 0, "prefix": 0}
    assert 0 < cached["prefix"] <= run["prompt_tokens"] and 0 <= cached["round_robin"] <= run["prompt_tokens"]
    assert run["prefix_over_round_robin"] == cached["prefix"] / max(1, cached["round_robin"])
    assert result["median_prefix_over_round_robin"] == run["prefix_over_round_robin"]
