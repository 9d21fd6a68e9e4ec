"""Speculative decoding in the engine (n-gram drafts, verified by features/speculative/rejection_sampler.py):
greedy output equals plain decoding token for token, with chunked prefill, preemption, small
blocks, prefix caching, n > 1, stop tokens and strings, logprobs and streaming; blocks holding
unverified tokens are never published; seeded sampling stays reproducible whatever the batch;
repetitive text takes fewer target forwards than tokens; the counts add up."""
import random

import pytest

import nanovllm.features.speculative.scheduling as speculation_module
from nanovllm import LLM, SamplingParams
from nanovllm.cli import build_parser
from nanovllm.features.speculative.policy import COMPUTE_BOUND_BATCH, PROBE_AFTER, draft_limit
from nanovllm.entrypoints.args import llm_from_args

MAX_LEN = 512


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(1, 400) for _ in range(rng.randint(5, 40))] for _ in range(12)]


@pytest.fixture(scope="module")
def plain(model_dir):
    with LLM(model_dir, max_model_len=MAX_LEN) as llm:
        yield llm


GREEDY = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, logprobs=2)
REPETITIVE = [11, 22, 33, 44, 55, 66, 77, 88] * 6


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 64}, {"num_kvcache_blocks": 40, "max_num_seqs": 12},
                                     {"kvcache_block_size": 4}],
                         ids=["plain", "chunked-prefill", "preemption", "small-blocks"])
def test_greedy_output_is_unchanged(model_dir, plain, prompts, k, options):
    expected = plain.generate(prompts, GREEDY, use_tqdm=False)
    with LLM(model_dir, max_model_len=MAX_LEN, speculative_config=ngram(k), **options) as llm:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
    assert [g["text"] for g in got] == [e["text"] for e in expected]
    for g, e in zip(got, expected):  # the target's logprobs of each emitted token
        for mine, theirs in zip(g["logprobs"], e["logprobs"]):
            assert mine.keys() == theirs.keys() and all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
    assert stats["spec_num_accepted_tokens"] > 0  # (drafts were accepted: the verification ran)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    if "num_kvcache_blocks" in options:
        assert stats["num_preemptions"] > 0


def test_stops_inside_an_accepted_run_end_the_sequence_there(model_dir, plain, prompts):
    """Stop tokens and strings picked from the plain output, late enough that drafts span them:
    the sequence ends where plain decoding ends, with the same text and reasons."""
    full = plain.generate(prompts, GREEDY, use_tqdm=False)
    params = []
    for out in full:
        ids = out["token_ids"]
        params.append(SamplingParams(temperature=0, max_tokens=120, stop_token_ids=[ids[60]]))
        text = out["text"]
        params.append(SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, stop=[text[len(text) // 2:][:3]]))
    doubled = [p for p in prompts for _ in range(2)]
    # Prompts that end inside a cycle the model keeps repeating (its own greedy continuation of a
    # repetitive prompt): most drafts are accepted, and a stop token met in the first tokens falls
    # inside an accepted run; a stop string after min_tokens, and max_tokens, too.
    context = plain.generate([REPETITIVE], GREEDY, use_tqdm=False)[0]["token_ids"]
    for cut in range(34, 56, 3):
        looping = REPETITIVE + context[:cut]
        continuation = plain.generate([looping], GREEDY, use_tqdm=False)[0]
        doubled += [looping] * 5
        params += [SamplingParams(temperature=0, max_tokens=120, stop_token_ids=[continuation["token_ids"][j]],
                                  logprobs=1) for j in (1, 2, 3)]
        params += [SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, min_tokens=cut - 20,
                                  stop=[continuation["text"][cut:cut + 2]]),
                   SamplingParams(temperature=0, max_tokens=cut - 25, ignore_eos=True)]
    expected = plain.generate(doubled, params, use_tqdm=False)
    with LLM(model_dir, max_model_len=MAX_LEN, speculative_config=ngram(4)) as llm:
        runs = []  # (the runs each sequence emitted: where its stop fell)
        complete = llm.scheduler.complete

        def recording(step, emitted, logprobs=None):
            if step.drafts:
                runs.extend(zip(step.sampling, emitted))
            return complete(step, emitted, logprobs)
        llm.scheduler.complete = recording
        got = llm.generate(doubled, params, use_tqdm=False)
    mid_run = sum(1 for seq, run in runs if seq.stop_reason in run[:-1] and seq.token_ids[-1] == seq.stop_reason)
    assert mid_run > 0, "no stop token fell inside an accepted run: the test tests nothing"
    for g, e in zip(got, expected):
        assert (g["token_ids"], g["text"], g["finish_reason"], g["stop_reason"]) == \
               (e["token_ids"], e["text"], e["finish_reason"], e["stop_reason"])
        assert [entry.keys() for entry in g.get("logprobs", [])] == [entry.keys() for entry in e.get("logprobs", [])]
    assert {e["finish_reason"] for e in expected} == {"stop", "length"}


def test_streaming_n_samples_and_prefix_caching(model_dir, prompts):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, n=2)
    repeated = [prompts[0] * 3, prompts[0] * 3]  # (the second call is served by the prefix cache)
    with LLM(model_dir, max_model_len=MAX_LEN) as fresh:  # (a cache as empty as the other's)
        expected = [fresh.generate([p], params, use_tqdm=False)[0] for p in repeated]
    with LLM(model_dir, max_model_len=MAX_LEN, speculative_config=ngram(3)) as llm:
        got = [llm.generate([p], params, use_tqdm=False)[0] for p in repeated]
        texts = {}
        for update in llm.stream(repeated, params):
            key = (update["index"], update["sample"])
            texts[key] = texts.get(key, "") + (update["text"] or "")
    assert [[s["token_ids"] for s in g["samples"]] for g in got] == [[s["token_ids"] for s in e["samples"]]
                                                                      for e in expected]
    assert [g["num_cached_tokens"] for g in got] == [e["num_cached_tokens"] for e in expected]
    assert got[1]["num_cached_tokens"] > 0
    assert texts == {(i, j): s["text"] for i, e in enumerate(expected) for j, s in enumerate(e["samples"])}


def test_unverified_blocks_are_never_published(model_dir, prompts):
    """After every step, every sequence's published blocks hold tokens the host knows (and so
    verified ones): drafts never reach the prefix cache."""
    with LLM(model_dir, max_model_len=MAX_LEN, kvcache_block_size=4, speculative_config=ngram(5)) as llm:
        seqs = [seq for p in prompts for seq in llm.add_request(p, GREEDY)]
        while not llm.is_finished():
            llm.step()
            for seq in llm.scheduler.running:
                assert len(seq.block_hashes) * 4 <= len(seq.token_ids)
                assert seq.num_computed_tokens == len(seq.token_ids) - 1 or seq.num_computed_tokens < seq.num_prompt_tokens
        assert all(seq.is_finished for seq in seqs) and llm.stats()["spec_num_accepted_tokens"] > 0


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_dir, prompts):
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=60, ignore_eos=True, seed=7)
    with LLM(model_dir, max_model_len=MAX_LEN, speculative_config=ngram(3)) as llm:
        alone = llm.generate([prompts[3]], params, use_tqdm=False)[0]["token_ids"]
        others = [SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=i) for i in range(5)]
        batch = llm.generate([*prompts[:5], prompts[3]], [*others, params], use_tqdm=False)[-1]["token_ids"]
        again = llm.generate([prompts[3]], SamplingParams(temperature=0.8, top_k=50, max_tokens=60, ignore_eos=True,
                                                          seed=8), use_tqdm=False)[0]["token_ids"]
    assert batch == alone and again != alone


def test_repetitive_text_takes_fewer_forwards_than_tokens(model_dir):
    """A prompt that repeats a phrase, continued greedily by a model that repeats it too: most
    drafts are accepted, and the target runs once per several tokens."""
    phrase = [11, 22, 33, 44, 55, 66, 77, 88]
    with LLM(model_dir, max_model_len=MAX_LEN) as plain:
        plain_out = plain.generate([phrase * 6], GREEDY, use_tqdm=False)[0]["token_ids"]
    with LLM(model_dir, max_model_len=MAX_LEN, speculative_config=ngram(4)) as llm:
        launches = 0
        launch = llm.model_runner.launch

        def counting(*args):
            nonlocal launches
            launches += 1
            return launch(*args)
        llm.model_runner.launch = counting
        out = llm.generate([phrase * 6], GREEDY, use_tqdm=False)[0]
        stats = llm.stats()
    assert out["token_ids"] == plain_out
    rate = stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]
    per_pos = stats["spec_num_accepted_tokens_per_pos"]
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == stats["spec_num_accepted_tokens"]
    assert out["metrics"]["spec_num_accepted_tokens"] == stats["spec_num_accepted_tokens"]
    assert out["metrics"]["spec_num_draft_tokens"] == stats["spec_num_draft_tokens"]
    print(f"acceptance {rate:.2f}; {launches} target forwards for {len(out['token_ids'])} tokens")
    assert launches < 0.75 * len(out["token_ids"]), (launches, rate)


@pytest.mark.parametrize("config, error, words", [
    ({"method": "eagle", "num_speculative_tokens": 2}, ValueError, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 1_000_000}, ValueError, r"\[1, 32\], got 1000000"),
    ({"method": "draft_model", "num_speculative_tokens": 33, "model": "x"}, ValueError, r"\[1, 32\]"),
    ({"method": "ngram"}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, ValueError, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, ValueError, "unknown keys"),
    ("{not json", ValueError, "JSON"),
    ([1], TypeError, "dict"),
])
def test_bad_speculative_configs_are_refused_at_start_up(model_dir, config, error, words):
    with pytest.raises(error, match=words):
        LLM(model_dir, max_model_len=64, speculative_config=config)


def test_the_cli_takes_speculative_config_as_json(model_dir):
    args = build_parser().parse_args(["serve", model_dir, "--max-model-len", "64", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 2}'])
    with llm_from_args(args) as llm:
        assert llm.config.speculative.num_speculative_tokens == 2


def test_draft_limit_policy():
    """All k drafts while they are accepted and the batch is small; fewer as acceptance drops
    or the batch grows (a draft costs more once the step is compute-bound); none when drafts
    miss, but one every PROBE_AFTER steps; a seeded request's limit ignores the batch."""
    assert draft_limit(4, 1.0, 0, 1, False) == 4
    assert draft_limit(4, 0.6, 0, 1, False) == 4         # 0.6**4 = 0.13 > 0.1
    assert draft_limit(4, 0.6, 0, 64, False) == 2        # cost 0.325: 0.36 > it, 0.216 not
    assert draft_limit(4, 0.9, 0, COMPUTE_BOUND_BATCH, False) == 0
    assert draft_limit(4, 0.9, 0, COMPUTE_BOUND_BATCH, True) == 4
    assert draft_limit(4, 0.05, 0, 1, False) == 0
    assert draft_limit(4, 0.05, PROBE_AFTER, 1, False) == 1


def test_speculation_backs_off_on_unpredictable_text_and_stays_on_for_repetitive_text(model_dir, monkeypatch):
    """Unpredictable: sampled text, where a 1-token n-gram almost always matches somewhere and
    proposes tokens the target rarely draws. Without adaptation nearly every step drafts k tokens
    that are mostly rejected; with it, drafting backs off to the probes. Repetitive: greedy text
    the model repeats keeps drafting k, nearly all accepted."""
    rng = random.Random(1)
    prompt = [rng.randrange(1, 400) for _ in range(200)]
    sampled = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, seed=3)
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 1}

    def drafts_per_token(params, prompt_ids, config=config):
        with LLM(model_dir, max_model_len=MAX_LEN, speculative_config=config) as llm:
            out = llm.generate([prompt_ids], params, use_tqdm=False)[0]
            stats = llm.stats()
        return stats["spec_num_draft_tokens"] / len(out["token_ids"]), stats
    adaptive, adaptive_stats = drafts_per_token(sampled, prompt)
    with monkeypatch.context() as m:
        m.setattr(speculation_module, "draft_limit", lambda k, *args, **kwargs: k)
        always, always_stats = drafts_per_token(sampled, prompt)
    print(f"unpredictable: {always:.2f} draft tokens per output token always, {adaptive:.2f} adaptive "
          f"(acceptance {always_stats['spec_num_accepted_tokens'] / always_stats['spec_num_draft_tokens']:.2f})")
    assert always > 2 and adaptive < always / 4
    repetitive, stats = drafts_per_token(SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), REPETITIVE,
                                         ngram(4))
    mean_length = 1 + stats["spec_num_accepted_tokens"] / stats["spec_num_drafts"]
    print(f"repetitive: {repetitive:.2f} draft tokens per output token, mean acceptance length {mean_length:.2f}")
    assert repetitive > 0.5 and mean_length > 1.5
