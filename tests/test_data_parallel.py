"""Data parallelism (distributed/data_parallel.py, router.py): replicas of the whole engine, each a
process, behind one front. The router's choices; a served model whose answers are LLM.generate's
whichever replica ran them; a replica killed mid-stream fails only its own requests (503);
scripts/bench_dp_routing.py's comparison of the routings."""
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
