"""Speculative decoding with a draft model (features/speculative/draft_model.py): greedy output equals plain
decoding token for token, with a draft identical to the target and with a smaller one of its own
(a narrower embedding table too), under chunked prefill, preemption, small blocks, prefix caching,
n > 1, stop tokens and streaming; an identical draft has every draft accepted, greedy or sampled,
so the target runs once per k + 1 tokens (its KV cache mirrors the target's: a revived or
recomputed block serves it too); sampled output follows the target's distribution, not the
draft's; seeded requests are reproducible whatever the batch; bad drafts are refused at start-up."""
import gc
import json
import math
import os
import random
import shutil
import weakref
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.cli import build_parser
from nanovllm.entrypoints.args import llm_from_args
from nanovllm.features.speculative.rejection_sampler import DRAFT_SALT
from nanovllm.utils.tiny_model import build_model, build_tokenizer

MAX_LEN = 512
GREEDY = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, logprobs=2)


def draft(path: str, k: int) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A smaller random model with the target's tokenizer: one layer, half the width, and an
    embedding table of 448 rows against the target's 512 (its q is 0 past them)."""
    return build_model(str(tmp_path_factory.mktemp("draft")), seed=5, num_hidden_layers=1, hidden_size=32,
                       intermediate_size=64, head_dim=8, vocab_size=448)


@pytest.fixture(scope="module")
def noisy_draft(tmp_path_factory, model_dir):
    """The target with noise on its weights (20% of each tensor's spread): its q overlaps p
    (about 40% of sampled drafts are accepted), so both acceptance and the residual draw run."""
    path = str(tmp_path_factory.mktemp("noisy_draft"))
    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    weights = load_file(os.path.join(path, "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    weights = {name: w if "norm" in name else w + 0.2 * w.std() * torch.randn(w.shape, generator=generator)
               for name, w in weights.items()}
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(1, 400) for _ in range(rng.randint(5, 40))] for _ in range(10)] + [
        [11, 22, 33, 44, 55, 66, 77, 88] * 6]


@pytest.fixture(scope="module")
def expected(model_dir, prompts):
    with LLM(model_dir, max_model_len=MAX_LEN) as llm:
        return llm.generate(prompts, GREEDY, use_tqdm=False)


def counting_launches(llm) -> list[int]:
    """Count the target's forwards (ModelRunner.launch calls) from now on: counter[0]."""
    counter, launch = [0], llm.model_runner.launch

    def counting(*args):
        counter[0] += 1
        return launch(*args)
    llm.model_runner.launch = counting
    return counter


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("which", ["identical", "small"])
@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 64}, {"num_kvcache_blocks": 40, "max_num_seqs": 11},
                                     {"kvcache_block_size": 4}],
                         ids=["plain", "chunked-prefill", "preemption", "small-blocks"])
def test_greedy_output_is_unchanged(model_dir, small_draft, prompts, expected, k, which, options):
    path = model_dir if which == "identical" else small_draft
    with LLM(model_dir, max_model_len=MAX_LEN, speculative_config=draft(path, k), **options) as llm:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]
    for g, e in zip(got, expected):  # the target's logprobs of each emitted token
        for mine, theirs in zip(g["logprobs"], e["logprobs"]):
            assert mine.keys() == theirs.keys() and all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
    assert stats["spec_num_draft_tokens"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]
    if which == "identical":  # the same model drafts what the target decodes
        assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    if "num_kvcache_blocks" in options:
        assert stats["num_preemptions"] > 0


def test_an_identical_draft_needs_one_target_forward_per_k_plus_1_tokens(model_dir):
    k, num_tokens = 4, 200
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    with LLM(model_dir, max_model_len=MAX_LEN, speculative_config=draft(model_dir, k)) as llm:
        launches = counting_launches(llm)
        out = llm.generate([[7, 8, 9, 10]], params, use_tqdm=False)[0]
        stats = llm.stats()
    assert len(out["token_ids"]) == num_tokens
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]
    per_pos = stats["spec_num_accepted_tokens_per_pos"]  # (the last drafts stop short of max_tokens)
    assert per_pos[0] == stats["spec_num_drafts"] and per_pos[-1] >= per_pos[0] - 1
    # the prefill samples the first token; every later forward emits k + 1 (the last ones fewer)
    print(f"{launches[0]} target forwards for {num_tokens} tokens (k = {k})")
    assert launches[0] <= 1 + math.ceil((num_tokens - 1) / (k + 1))


def test_its_kv_cache_follows_the_targets_blocks(model_dir):
    """An identical draft accepts every draft only if its K/V at every position is right: prompts
    sharing a prefix (blocks revived from the prefix cache, computed for another request), chunked
    prefill, preemption under a tiny KV budget (blocks recomputed), n > 1 (a prompt's blocks shared
    by its samples), sampled rows too (p = q: accepted whatever the draw)."""
    rng = random.Random(2)
    prefix = [rng.randrange(1, 400) for _ in range(40)]
    prompts = [prefix + [rng.randrange(1, 400) for _ in range(rng.randint(1, 20))] for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, n=2),
              SamplingParams(temperature=0.8, top_k=20, max_tokens=80, ignore_eos=True, seed=1)] * 4
    with LLM(model_dir, max_model_len=192, speculative_config=draft(model_dir, 3), num_kvcache_blocks=24,
             max_num_batched_tokens=48) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_cached_tokens"] > 0
    assert all(len(o["token_ids"]) == 80 for o in outs)
    drafted, accepted = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
    print(f"acceptance {accepted / drafted:.4f} of {drafted} drafts")
    assert accepted >= 0.99 * drafted  # (sampled rows: p and q from two forwards, equal up to rounding)


def test_stops_streaming_and_n_samples(model_dir, small_draft, prompts, expected):
    """A stop token or string met inside an accepted run ends the sequence there; streamed text
    adds up; n samples each get the plain greedy continuation."""
    params = [SamplingParams(temperature=0, max_tokens=100, stop_token_ids=[e["token_ids"][50]], n=2)
              for e in expected]
    params += [SamplingParams(temperature=0, max_tokens=100, ignore_eos=True,
                              stop=[e["text"][len(e["text"]) // 2:][:3]]) for e in expected]
    prompts, last = prompts + prompts, len(expected) - 1  # (the last n = 2 request is streamed too)
    def runs(outputs):
        return [[(s["token_ids"], s["text"], s["finish_reason"]) for s in o.get("samples", [o])] for o in outputs]
    with LLM(model_dir, max_model_len=MAX_LEN) as llm:
        plain = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o["finish_reason"] == "stop" for o in plain[len(expected):]) > len(expected) // 2  # (strings met)
    for path in (model_dir, small_draft):
        with LLM(model_dir, max_model_len=MAX_LEN, speculative_config=draft(path, 4)) as llm:
            got = llm.generate(prompts, params, use_tqdm=False)
            streamed = {}
            for update in llm.stream(prompts[last:last + 1], params[last:last + 1]):
                streamed[update["sample"]] = streamed.get(update["sample"], "") + (update["text"] or "")
        assert runs(got) == runs(plain)
        assert [streamed[j] for j in sorted(streamed)] == [s["text"] for s in plain[last]["samples"]]


def total_variation(a: Counter, b: Counter) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[t] / na - b[t] / nb) for t in set(a) | set(b))


def bhc_bound(num_draws: int, num_outcomes: int, delta: float) -> float:
    """Bretagnolle-Huber-Carol: the empirical distribution of num_draws draws over num_outcomes
    outcomes is within this total-variation distance of the truth with probability 1 - delta."""
    return math.sqrt((num_outcomes * math.log(2) + math.log(2 / delta)) / (2 * num_draws))


def test_sampled_output_follows_the_target_not_the_draft(model_dir, noisy_draft):
    """N seeded samples of three tokens with top-k 4; the first comes from the prefill, the next
    two from verification. The distribution of the second given the most common first one, and
    of the third given the most common first two (at most 4 outcomes each): with the small draft
    it is within the bound of plain sampling's (the sum of both histograms' BHC bounds at a
    failure probability of 1e-6 each), and far from the draft model's own."""
    n, m, delta = 6000, 4, 1e-6
    prompt = [5, 17, 33, 2, 9]
    params = [SamplingParams(temperature=1.0, top_k=m, max_tokens=3, ignore_eos=True, seed=i) for i in range(n)]

    def samples(path, speculative_config=None, prompt=prompt, params=params):
        with LLM(path, max_model_len=64, max_num_seqs=512, speculative_config=speculative_config) as llm:
            outs = llm.generate([prompt] * n, params, use_tqdm=False)
            stats = llm.stats()
        return [o["token_ids"] for o in outs], stats
    plain, _ = samples(model_dir)
    speculative, stats = samples(model_dir, draft(noisy_draft, 3))
    acceptance = stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]
    assert stats["spec_num_draft_tokens"] >= n and 0.1 < acceptance < 0.9  # (verification decided them)
    for j in (1, 2):
        context = Counter(tuple(t[:j]) for t in plain).most_common(1)[0][0]

        def given(runs):
            return Counter(t[j] for t in runs if tuple(t[:j]) == context)
        p, s = given(plain), given(speculative)
        # the draft model's q there: its own sampling after the prompt and the context
        d = Counter(t[0] for t in samples(noisy_draft, None, prompt + list(context),
                                          [SamplingParams(temperature=1.0, top_k=m, max_tokens=1, seed=i)
                                           for i in range(n)])[0])
        bound = bhc_bound(sum(p.values()), m, delta) + bhc_bound(sum(s.values()), m, delta)
        print(f"token {j + 1} after {context}: TV(speculative, plain) {total_variation(s, p):.3f} (bound "
              f"{bound:.3f}, {sum(s.values())} and {sum(p.values())} draws), TV(draft's own, plain) "
              f"{total_variation(d, p):.3f}")
        assert total_variation(s, p) < bound
        assert total_variation(d, p) > 2 * bound


def test_seeded_sampling_is_reproducible_whatever_the_batch(model_dir, noisy_draft, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=60, ignore_eos=True, seed=11)
    others = SamplingParams(temperature=1.0, max_tokens=60, ignore_eos=True)
    with LLM(model_dir, max_model_len=MAX_LEN, speculative_config=draft(noisy_draft, 3)) as llm:
        alone = llm.generate(prompts[:1], params, use_tqdm=False)[0]["token_ids"]
        batched = llm.generate(prompts, [params] + [others] * (len(prompts) - 1), use_tqdm=False)[0]["token_ids"]
    assert alone == batched



def test_drafts_come_from_a_noise_stream_of_their_own(model_dir):
    """A draft model draws draft j from the uniform of (seed ^ DRAFT_SALT, its position), not the
    request's own (seed, position): that one is the uniform a rejection's residual draw then uses,
    and a draft correlated with its residual draw makes the output drift from p, by too little for
    the sampled-distribution test above to see. With an identical draft every draft is accepted
    (p = q), so a seeded request's tokens 2..k+1 are its drafts: they equal plain sampling's, after
    the same first token, with the seed ^ DRAFT_SALT (the same uniforms at the same positions), and
    not plain sampling's with the request's own seed (which the check tells apart)."""
    k, seeds, prompt = 3, range(12), [7, 8, 9, 10]

    def params(seed, max_tokens):
        return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed)
    with LLM(model_dir, max_model_len=64, speculative_config=draft(model_dir, k)) as llm:
        spec = [o["token_ids"] for o in llm.generate([prompt] * len(seeds), [params(s, k + 2) for s in seeds],
                                                     use_tqdm=False)]
        stats = llm.stats()
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] >= k * len(seeds)
    with LLM(model_dir, max_model_len=64) as llm:
        def plain(seed_of):
            return [o["token_ids"] for o in llm.generate([prompt + t[:1] for t in spec],
                                                         [params(seed_of(s), k) for s in seeds], use_tqdm=False)]
        salted, own = plain(lambda s: s ^ DRAFT_SALT), plain(lambda s: s)
    assert [t[1:k + 1] for t in spec] == salted
    assert sum(a != b for a, b in zip(salted, own)) >= len(seeds) // 2


@pytest.fixture(scope="module")
def bad_drafts(tmp_path_factory, model_dir):
    """Draft folders a target must refuse: another tokenizer; too few positions."""
    root = tmp_path_factory.mktemp("bad_drafts")
    other_tokenizer = build_model(str(root / "tokenizer"), seed=3)
    for name in os.listdir(other_tokenizer):
        if "token" in name or name == "vocab.json" or name == "merges.txt":
            os.remove(os.path.join(other_tokenizer, name))
    build_tokenizer(other_tokenizer, vocab_size=300)
    short = build_model(str(root / "short"), seed=3, max_position_embeddings=32)
    no_config = str(root / "no_config")
    shutil.copytree(model_dir, no_config)
    os.remove(os.path.join(no_config, "config.json"))
    return {"tokenizer": other_tokenizer, "short": short, "no_config": no_config}


@pytest.mark.parametrize("config, error, words", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "needs \"model\""),
    ({"method": "draft_model", "model": "{no_config}", "num_speculative_tokens": 2}, ValueError, "no config.json"),
    ({"method": "draft_model", "model": "{tokenizer}", "num_speculative_tokens": 2}, ValueError,
     "different tokenizer vocabulary"),
    ({"method": "draft_model", "model": "{short}", "num_speculative_tokens": 2}, ValueError, "max_position_embeddings"),
    ({"method": "draft_model", "model": "{target}", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
    ({"method": "draft_model", "model": "{target}", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, ValueError,
     "unknown keys"),
], ids=["no-model", "no-config", "other-tokenizer", "too-few-positions", "k-0", "ngram-key"])
def test_bad_drafts_are_refused_at_start_up(model_dir, bad_drafts, config, error, words):
    if "model" in config:
        config = {**config, "model": config["model"].format(target=model_dir, **bad_drafts)}
    with pytest.raises(error, match=words):
        LLM(model_dir, max_model_len=64, speculative_config=config)


def test_the_cli_takes_a_draft_model(model_dir, small_draft):
    args = build_parser().parse_args(["serve", model_dir, "--max-model-len", "64", "--speculative-config",
                                      json.dumps(draft(small_draft, 2))])
    with llm_from_args(args) as llm:
        assert llm.config.speculative.model == small_draft
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        assert len(out["token_ids"]) == 8 and llm.stats()["spec_num_draft_tokens"] > 0


def test_the_kv_caches_go_with_the_engine(model_dir):
    """The runner holds the draft model and not the other way round: dropping the engine frees both
    KV caches at once, with no reference cycle left for the garbage collector (on a GPU that
    memory would count as used by the next engine in the process)."""
    llm = LLM(model_dir, max_model_len=64, speculative_config=draft(model_dir, 2))
    llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    caches = [weakref.ref(llm.model_runner.kv_cache), weakref.ref(llm.model_runner.drafter.kv_cache)]
    gc.disable()
    try:
        del llm
        assert [cache() is None for cache in caches] == [True, True]
    finally:
        gc.enable()
