"""Sampling controls, stop conditions, n > 1, logprobs and streaming."""
import json
import math
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers import top_k_top_p as sampler_module
from nanovllm.features import logits_processors
from nanovllm.features.logits_processors import ProcessorTensors, apply_penalties
from nanovllm.layers.inverse_transform import sample_from, uniform_per_row
from nanovllm.layers.sampler import Sampler, SamplingBatch
from nanovllm.layers.top_k_top_p import apply_min_p, apply_top_k_top_p, filter_candidates, sample_filtered

# chi-square critical value for 7 degrees of freedom at p = 0.001: a correct sampler fails the
# test with probability 0.1% for a random seed, and never for the fixed one below.
CHI2_7DOF_P001 = 24.32


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=400)


def sample_many(logits, temperature, rows, **options):
    batch = SamplingBatch(temperatures=torch.full((rows,), temperature), seeds=torch.arange(rows) * 7919 + 1,
                          positions=torch.full((rows,), 5, dtype=torch.int64), **options)
    return draw(logits.expand(rows, -1).clone(), batch)


def draw(logits, batch):
    """The Sampler's final tokens: its rows flagged for a full-way redraw redrawn (as the model
    runner does when it reads the tokens)."""
    tokens, _, redo = Sampler()(logits, batch)
    if redo is not None:
        redo.redraw_into(tokens)
    return tokens


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_softmax(temperature):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    rows = 40_000
    counts = torch.bincount(sample_many(logits, temperature, rows), minlength=8).double()
    expected = torch.softmax(logits[0].double() / temperature, -1) * rows
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_7DOF_P001, (chi2, counts, expected)


def test_top_k_top_p_min_p_zero_exactly_the_right_tokens():
    probs = torch.tensor([[0.05, 0.40, 0.10, 0.25, 0.20]])
    # top_k=2 keeps 0.40 and 0.25; top_p=0.6 keeps 0.40, 0.25 (mass before 0.25 is 0.40 < 0.6)
    kept = apply_top_k_top_p(probs, torch.tensor([2]), torch.tensor([1.0]))
    assert (kept > 0).tolist() == [[False, True, False, True, False]]
    kept = apply_top_k_top_p(probs, torch.tensor([-1]), torch.tensor([0.6]))
    assert (kept > 0).tolist() == [[False, True, False, True, False]]
    kept = apply_top_k_top_p(probs, torch.tensor([-1]), torch.tensor([0.66]))  # 0.65 < 0.66: 0.20 joins
    assert (kept > 0).tolist() == [[False, True, False, True, True]]
    kept = apply_min_p(probs, torch.tensor([0.5]))  # threshold 0.2: drops 0.05 and 0.10
    assert (kept > 0).tolist() == [[False, True, False, True, True]]
    logits = probs.log()
    for options, allowed in [(dict(top_ks=torch.full((2000,), 2), top_ps=torch.ones(2000)), {1, 3}),
                             (dict(min_ps=torch.full((2000,), 0.55)), {1, 3})]:
        assert set(sample_many(logits, 1.0, 2000, **options).tolist()) == allowed


def _reference_filter(probs, top_ks, top_ps, min_ps):
    """The full sort over the whole vocabulary (the sampler's fallback, whose exact masks
    test_top_k_top_p_min_p_zero_exactly_the_right_tokens pins): the semantics the candidate path keeps."""
    if top_ks is not None:
        probs = apply_top_k_top_p(probs, top_ks, top_ps)
    if min_ps is not None:
        probs = probs.masked_fill(probs < min_ps[:, None] * probs.amax(-1, keepdim=True), 0.0)
    return probs


def hard_rows(vocab, k, device="cpu", seed=0):
    """Probabilities [R, V] and per-row (top_ks, top_ps, min_ps) [R]: every combination of shapes of
    distribution (ties everywhere, underflow to 0, long runs of equal values at every cut) and
    filters around the candidate count k (top_p too large for the candidates, top_k above k)."""
    g = torch.Generator().manual_seed(seed)
    zipf = -1.1 * torch.arange(1, vocab + 1).double().log().float()
    shapes = [lambda x: x, lambda x: 6 * x, lambda x: 60 * x, lambda x: 0 * x,
              lambda x: (2 * x).bfloat16().float(), lambda x: (2 * x).round(),
              lambda x: zipf[torch.randperm(vocab, generator=g)]]
    top_ks = [-1, 1, 2, 50, k - 1, k, k + 1, 2 * k]
    top_ps = [1e-6, 0.5, 0.9, 0.99, 0.9999, 1.0]
    min_ps = [0.0, 0.01, 0.05, 0.5, 1.0]
    combos = [(s, tk, tp, mp) for s in shapes for tk in top_ks for tp in top_ps for mp in min_ps]
    logits = torch.stack([s(torch.randn(vocab, generator=g)) for s, *_ in combos])
    params = [torch.tensor([c[i] for c in combos], device=device) for i in (1, 2, 3)]
    return torch.softmax(logits.to(device), -1), *params


FILTERS = {"top_k+top_p+min_p": (True, True), "top_k+top_p": (True, False), "min_p": (False, True)}
VOCAB_FOR = {16: 500, 1024: 3000}  # candidates -> a vocabulary with room for top_k = 2 * candidates


@pytest.mark.parametrize("k", [16, 1024])
@pytest.mark.parametrize("filters", FILTERS)
def test_filter_candidates_keep_exactly_what_the_full_sort_keeps(monkeypatch, k, filters):
    """Rows the candidate path vouches for have, bit for bit, the full sort's filtered probabilities;
    and it does not vouch for rows whose kept set may reach past the candidates."""
    monkeypatch.setattr(sampler_module, "NUM_CANDIDATES", k)
    probs, top_ks, top_ps, min_ps = hard_rows(VOCAB_FOR[k], k)
    top_k_top_p, min_p = FILTERS[filters]
    args = (top_ks if top_k_top_p else None, top_ps if top_k_top_p else None, min_ps if min_p else None)
    ids, kept, exact = filter_candidates(probs, *args)
    expected = _reference_filter(probs, *args)
    got = torch.zeros_like(probs).scatter(-1, ids, kept)
    assert torch.equal(got[exact], expected[exact])
    assert 0.2 < exact.float().mean() < 0.9, exact.float().mean()  # both paths exercised
    needs_more = (expected > 0).sum(-1) >= k
    assert not (exact & needs_more).any()


@pytest.mark.parametrize("k", [16, 1024])
@pytest.mark.parametrize("filters", FILTERS)
def test_sample_filtered_draws_the_full_sort_samplers_tokens(monkeypatch, k, filters):
    monkeypatch.setattr(sampler_module, "NUM_CANDIDATES", k)
    probs, top_ks, top_ps, min_ps = hard_rows(VOCAB_FOR[k], k, seed=1)
    top_k_top_p, min_p = FILTERS[filters]
    args = (top_ks if top_k_top_p else None, top_ps if top_k_top_p else None, min_ps if min_p else None)
    expected_probs = _reference_filter(probs, *args)
    rows = probs.shape[0]
    for position in range(3):
        uniform = uniform_per_row(torch.arange(rows) * 7919 + 1, torch.full((rows,), position))
        assert torch.equal(sample_filtered(probs, uniform, *args), sample_from(expected_probs, uniform))


def test_sample_filtered_redoes_rows_whose_draw_is_near_a_boundary(monkeypatch):
    """A target near a cumulative boundary (where summing in another order could pick the neighbour)
    sends the row the full way; with a huge tolerance almost every row goes, with the same tokens."""
    probs, top_ks, top_ps, min_ps = hard_rows(3000, 1024, seed=2)
    uniform = uniform_per_row(torch.arange(probs.shape[0]), torch.zeros(probs.shape[0], dtype=torch.int64))
    expected = sample_from(_reference_filter(probs, top_ks, top_ps, min_ps), uniform)
    redone = []
    full_sample_from = sampler_module.sample_from
    monkeypatch.setattr(sampler_module, "sample_from", lambda p, u: redone.append(len(u)) or full_sample_from(p, u))
    monkeypatch.setattr(sampler_module, "CDF_TOLERANCE", 0.25)
    assert torch.equal(sample_filtered(probs, uniform, top_ks, top_ps, min_ps), expected)
    assert redone and redone[0] > 0.5 * probs.shape[0]


def test_sampler_with_filters_matches_full_sort_sampler():
    """The Sampler end to end (temperatures, greedy rows, all three filters) against softmax, the
    full-sort filters and inverse-transform sampling."""
    probs, top_ks, top_ps, min_ps = hard_rows(3000, 1024, seed=3)
    logits, rows = probs.log().clamp(min=-1e4), probs.shape[0]
    temperatures = torch.tensor([0.0, 0.3, 1.0, 1.7]).repeat(rows // 4 + 1)[:rows]
    seeds, positions = torch.arange(rows) * 31 + 7, torch.full((rows,), 11)
    tokens = draw(logits, SamplingBatch(temperatures=temperatures, seeds=seeds, positions=positions,
                                        top_ks=top_ks, top_ps=top_ps, min_ps=min_ps))
    sampling = temperatures > 0
    scaled = torch.softmax(logits / torch.where(sampling, temperatures, 1.0)[:, None], -1)
    sampled = sample_from(_reference_filter(scaled, top_ks, top_ps, min_ps), uniform_per_row(seeds, positions))
    assert torch.equal(tokens, torch.where(sampling, sampled, logits.argmax(-1)))


def test_penalties_match_direct_computation():
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    prompt = [[1, 2], [3], [0]]
    completion = [[2, 2, 5], [], [9, 0, 9, 9]]
    presence, frequency, repetition = [0.5, 0.0, -1.0], [0.3, 1.0, 0.2], [1.3, 1.0, 0.7]
    expected = logits.clone()
    for i in range(3):
        for t in set(prompt[i] + completion[i]):
            x = expected[i, t]
            expected[i, t] = x / repetition[i] if x > 0 else x * repetition[i]
        for t in set(completion[i]):
            expected[i, t] -= presence[i] + frequency[i] * completion[i].count(t)
    padded = lambda lists: torch.tensor([l + [10] * (6 - len(l)) for l in lists])  # noqa: E731  (pad id = V)
    seen = padded([p + c for p, c in zip(prompt, completion)])
    got = apply_penalties(logits, seen, padded(completion), torch.tensor(presence), torch.tensor(frequency),
                          torch.tensor(repetition))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_see_every_token_before_the_one_sampled(model_dir, async_scheduling, monkeypatch):
    """The penalties read each sequence's tokens from the device's token table: the prompt
    (prefix-cache hits included, which no step computes), and every completion token, the one
    still in flight under overlap included. Checked against the tokens the host has at the end,
    under chunked prefill, prefix hits and preemption, with a row without penalties in the batch."""
    llm = LLM(model_dir, max_model_len=80, num_kvcache_blocks=10, kvcache_block_size=8, max_num_batched_tokens=32,
              async_scheduling=async_scheduling)
    seen_by_step = []  # (the sampling sequences, positions sampled, seen, generated) per penalized step
    inputs_of = llm.scheduler.sampling_inputs
    penalty_tokens = logits_processors.penalty_tokens
    last = {}

    def record_inputs(step, batch):
        inputs = inputs_of(step, batch)
        last["seqs"], last["positions"] = list(step.sampling), inputs.positions.tolist()
        return inputs

    def record_penalty_tokens(*args):
        seen, generated = penalty_tokens(*args)
        seen_by_step.append((last["seqs"], last["positions"], seen.tolist(), generated.tolist()))
        return seen, generated
    llm.scheduler.sampling_inputs = record_inputs
    monkeypatch.setattr(logits_processors, "penalty_tokens", record_penalty_tokens)
    shared = list(range(100, 140))
    penalized = SamplingParams(temperature=0.9, seed=1, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.4)
    plain = SamplingParams(temperature=0.9, seed=2, max_tokens=20)
    llm.generate([shared + [1, 2, 3], shared + [4], list(range(200, 230))], [penalized, penalized, plain],
                 use_tqdm=False)
    pad = llm.config.hf_config.vocab_size
    checked = 0
    for seqs, positions, seen, generated in seen_by_step:
        for seq, position, seen_row, generated_row in zip(seqs, positions, seen, generated):
            if not seq.sampling_params.has_penalties:
                continue
            assert [t for t in seen_row if t != pad] == seq.token_ids[:position]
            assert [t for t in generated_row if t != pad] == seq.token_ids[seq.num_prompt_tokens:position]
            checked += 1
    stats = llm.stats()
    assert checked > 30 and stats["num_cached_tokens"] > 0 and stats["num_preemptions"] > 0


def test_repetition_penalty_matches_hf(model_dir, llm, prompts):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt in prompts[2:5]:
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                      repetition_penalty=1.3), use_tqdm=False)
        assert out["token_ids"] == ref


def test_greedy_filters_equal_greedy(llm, prompts):
    greedy = [o["token_ids"] for o in llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=24,
                                                                               ignore_eos=True), use_tqdm=False)]
    for params in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        out = llm.generate(prompts[:3], SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, **params),
                           use_tqdm=False)
        assert [o["token_ids"] for o in out] == greedy, params


def test_seed_reproducible_alone_and_in_a_batch_of_32(llm, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=32, ignore_eos=True)
    alone = llm.generate([prompts[3]], seeded, use_tqdm=False)[0]["token_ids"]
    others = [SamplingParams(temperature=0.7, max_tokens=8 + i, ignore_eos=True) for i in range(32)]
    batch = llm.generate([prompts[i % 8] for i in range(32)] + [prompts[3]], others + [seeded], use_tqdm=False)
    assert batch[-1]["token_ids"] == alone
    other = llm.generate([prompts[3]], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=32,
                                                      ignore_eos=True), use_tqdm=False)[0]["token_ids"]
    assert other != alone


def test_stop_string_spanning_tokens(llm):
    prompt = "Prefix caching shares"
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    [full] = llm.generate([prompt], params, use_tqdm=False)
    ids, tok = full["token_ids"], llm.tokenizer
    # a stop string made of the last character of token k's text and the first of token k+1's,
    # first occurring right there
    texts = [tok.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    def spanning(k):
        piece = texts[k + 1][len(texts[k]) - 1:len(texts[k]) + 1]
        return (len(texts[k - 1]) < len(texts[k]) < len(texts[k + 1]) and "\ufffd" not in piece
                and full["text"].find(piece) == len(texts[k]) - 1)
    k = next(k for k in range(3, 38) if spanning(k))
    stop = texts[k + 1][len(texts[k]) - 1:len(texts[k]) + 1]
    cut = len(texts[k]) - 1
    for include in (False, True):
        [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "zzzz"],
                                                      include_stop_str_in_output=include), use_tqdm=False)
        assert out["text"] == full["text"][:cut + (len(stop) if include else 0)]
        assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
        assert out["token_ids"] == ids[:len(out["token_ids"])] and len(out["token_ids"]) < len(ids)


def test_stop_token_ids_and_min_tokens(llm, prompts):
    ids = llm.generate([prompts[4]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0]["token_ids"]
    stop_id = ids[6]
    first = ids.index(stop_id)
    [out] = llm.generate([prompts[4]], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
                         use_tqdm=False)
    assert out["token_ids"] == ids[:first + 1]
    assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop_id)
    [late] = llm.generate([prompts[4]], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id],
                                                       min_tokens=first + 3), use_tqdm=False)
    assert len(late["token_ids"]) >= first + 3 and stop_id not in late["token_ids"][:first + 2]


def copy_with_eos(model_dir, folder, eos_token_id):
    """The test model whose config.json and generation_config.json name `eos_token_id` as EOS."""
    shutil.copytree(model_dir, folder)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = eos_token_id
        (folder / name).write_text(json.dumps(config))
    return str(folder)


def streamed(llm, prompt, params) -> tuple[list[int], dict]:
    """stream()'s token ids, concatenated, and its last update."""
    updates = list(llm.stream([prompt], params))
    assert updates[-1]["finished"] and not any(u["finished"] for u in updates[:-1])
    return [t for u in updates for t in u["token_ids"]], updates[-1]


def test_eos_stop_has_no_stop_reason_and_a_stop_token_names_its_id(model_dir, llm, prompts, tmp_path):
    """Stopped by EOS: finish_reason "stop" and stop_reason None (as vLLM: stop_reason names only a
    stop string or a stop_token_ids entry); stopped by a stop_token_ids entry: stop_reason is that
    id. Both in generate()'s output and in stream()'s last update. EOS is a token the greedy run
    produces, through a model copy whose configs say so."""
    prompt = prompts[4]
    ids = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0]["token_ids"]
    firsts = [i for i, t in enumerate(ids) if ids.index(t) == i]   # positions of first occurrences
    stop_at, eos_at = firsts[2], firsts[4]
    eos_llm = LLM(copy_with_eos(model_dir, tmp_path / "eos", ids[eos_at]), max_model_len=400)
    cases = [(SamplingParams(temperature=0, max_tokens=30), eos_at, None),
             (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[stop_at]]), stop_at, ids[stop_at])]
    for params, end, stop_reason in cases:
        [out] = eos_llm.generate([prompt], params, use_tqdm=False)
        assert out["token_ids"] == ids[:end + 1]
        assert (out["finish_reason"], out["stop_reason"]) == ("stop", stop_reason)
        tokens, last = streamed(eos_llm, prompt, params)
        assert tokens == ids[:end + 1]
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop_reason)


def test_n_samples_share_prompt_blocks(model_dir, prompts):
    prompt = prompts[6]  # 257 tokens: 16 full blocks
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=5)
    shared = LLM(model_dir, max_model_len=400)
    [out] = shared.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=5, n=4),
                            use_tqdm=False)
    separate = LLM(model_dir, max_model_len=400)
    separate.generate([prompt] * 4, params, use_tqdm=False)
    assert len(out["samples"]) == 4 and out["token_ids"] == out["samples"][0]["token_ids"]
    assert len({tuple(s["token_ids"]) for s in out["samples"]}) == 4  # distinct samples
    assert shared.stats()["peak_used_blocks"] < separate.stats()["peak_used_blocks"]
    assert shared.stats()["num_cached_tokens"] == 3 * 256
    assert shared.stats()["num_free_blocks"] == shared.stats()["num_blocks"]


def test_logprobs_match_hf(model_dir, llm, prompts):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = prompts[3]
    [out] = llm.generate([prompt], SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True, logprobs=3),
                         use_tqdm=False)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out["token_ids"]])).logits[0].float()
    reference = torch.log_softmax(logits[len(prompt) - 1:-1], -1)  # the distribution each token was drawn from
    assert len(out["logprobs"]) == 12
    for step, (token, entry) in enumerate(zip(out["token_ids"], out["logprobs"])):
        top = reference[step].topk(3)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for t, lp in entry.items():
            assert math.isclose(lp, float(reference[step, t]), abs_tol=1e-4)


def metaspace_model(model_dir, folder):
    """The test model with a SentencePiece-style tokenizer, whose decoder merges and strips spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from nanovllm.utils.tiny_model import CORPUS, EOS_TOKEN
    shutil.copytree(model_dir, folder)
    for f in folder.glob("tokenizer*"):
        f.unlink()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS_TOKEN, "<unk>"],
                                                        show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, unk_token="<unk>").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = tok.token_to_id(EOS_TOKEN)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("tokenizer", ["byte_level", "metaspace"])
def test_stream_concatenates_to_generate(model_dir, tmp_path, tokenizer):
    path = model_dir if tokenizer == "byte_level" else metaspace_model(model_dir, tmp_path / "sp")
    llm = LLM(path, max_model_len=400)
    prompts = ["日本語のテキストと絵文字 🚀", "Continuous batching lets", "naïve café façade", "def forward(self"]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=40, ignore_eos=True) for i in range(4)]
    params.append(SamplingParams(temperature=0.9, seed=7, max_tokens=40, ignore_eos=True, n=2, stop=["e"]))
    prompts.append("The quick brown fox")
    expected = llm.generate(prompts, params, use_tqdm=False)
    texts, ids, finals, order = {}, {}, {}, []
    for update in llm.stream(prompts, params):
        key = (update["index"], update["sample"])
        assert key not in finals, "update after the last one"
        texts[key] = texts.get(key, "") + update["text"]
        ids[key] = ids.get(key, []) + update["token_ids"]
        order.append(update["index"])
        if update["finished"]:
            finals[key] = update
    for i, out in enumerate(expected):
        for j, sample in enumerate(out.get("samples", [out])):
            assert texts[(i, j)] == sample["text"] and ids[(i, j)] == sample["token_ids"]
            assert finals[(i, j)]["finish_reason"] == sample["finish_reason"]
    multibyte = [c for o in expected for c in o["text"] if ord(c) > 127 and c != "\ufffd"]
    assert multibyte, "the outputs should exercise multi-byte characters"
    assert order != sorted(order), "requests should interleave (continuous batching)"
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


@pytest.mark.parametrize("chars_before", [1, 2])
def test_streamed_text_holds_back_a_stop_string_that_spans_tokens(llm, chars_before):
    """A stop string of chars_before + 1 characters: the last chars_before of token k's text and the
    first of token k+1's, first occurring there. While streaming, the text that could still be the
    start of a stop string is held back, so no update ever shows what generate() cuts off: the
    pieces concatenate to generate()'s text, and every partial concatenation is a prefix of it."""
    prompt = "Prefix caching shares"
    [full] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    ids, tok = full["token_ids"], llm.tokenizer
    texts = [tok.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]

    def stop_at(k):
        return texts[k + 1][len(texts[k]) - chars_before:len(texts[k]) + 1]

    def spanning(k):
        return (len(texts[k]) - chars_before >= len(texts[k - 1]) and len(texts[k + 1]) > len(texts[k])
                and "\ufffd" not in stop_at(k) and full["text"].find(stop_at(k)) == len(texts[k]) - chars_before)
    k = next(k for k in range(3, len(ids) - 2) if spanning(k))
    stop = stop_at(k)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    [expected] = llm.generate([prompt], params, use_tqdm=False)
    assert expected["text"] == full["text"][:len(texts[k]) - chars_before] and expected["stop_reason"] == stop
    text = ""
    for update in llm.stream([prompt], params):
        text += update["text"]
        assert expected["text"].startswith(text), f"streamed {text!r}, beyond generate()'s {expected['text']!r}"
    assert text == expected["text"] and update["stop_reason"] == stop


def test_abandoned_stream_frees_its_blocks(llm, prompts):
    stream = llm.stream(prompts[:4], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
    assert not llm.scheduler.running and not llm.scheduler.waiting


def test_sampler_microbenchmark_runs():
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import bench_sampler
    results = bench_sampler.main(["--batch", "4", "--vocab", "1000", "--prompt-len", "8", "--output-len", "8",
                                  "--iters", "1"])
    # gpu_check's top_p step reads the two plain draws by these names
    plain = {"plain: temperature", "plain: sort-based top_p"}
    assert set(results) == set(bench_sampler.CONFIGS) | plain and all(t > 0 for t in results.values())


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_sampler_never_waits_for_the_device(vocab):
    """Penalties, min_tokens' banned tokens, top-k/top-p/min-p and logprobs: none may wait for the
    device, so a step's launch returns while the device works (overlap scheduling). Rows the
    candidates cannot vouch for are only flagged (Redo), and redrawn when the tokens are read."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    rows = 8
    logits = torch.randn(rows, vocab, device=device)
    ones = torch.ones(rows, device=device)
    ints = torch.arange(rows, device=device)
    seen = torch.randint(0, vocab, (rows, 20), device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = SamplingBatch(temperatures=ones, seeds=ints, positions=ints, top_ks=ints + 5, top_ps=ones * 0.9,
                              min_ps=ones * 0.01, num_logprobs=3,
                              processors=ProcessorTensors(penalties=(seen, seen, ones, ones, ones * 1.1), banned=(ints, ints)))
        Sampler()(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_sample_filtered_draws_the_full_sort_samplers_tokens_on_cuda():
    """On CUDA too (tree-shaped cumulative sums, stable radix sorts): hard rows, and a batch the size
    of the benchmark's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    big = torch.softmax(torch.randn(256, 151936, device="cuda") / 0.8, -1)
    full = lambda x: torch.full((256,), x, device="cuda")  # noqa: E731
    for probs, top_ks, top_ps, min_ps in [hard_rows(5000, 1024, device="cuda"),
                                          (big, full(50), full(0.9), full(0.05)),
                                          (big, full(-1), full(0.9), None)]:
        rows = probs.shape[0]
        ints = torch.arange(rows, device="cuda")
        uniform = uniform_per_row(ints, ints * 0)
        expected = sample_from(_reference_filter(probs, top_ks, top_ps, min_ps), uniform)
        assert torch.equal(sample_filtered(probs, uniform, top_ks, top_ps, min_ps), expected)


@pytest.mark.parametrize("vocab", [1, 7, 1024, 1025, 3000])
def test_two_level_draw_equals_one_cumulative_sum(vocab):
    """sample_from finds the chunk, then the token (no [B, V] float64 array): the same token as the
    first index where one float64 cumulative sum over the vocabulary reaches u * total, and never
    a token of probability 0 (30% of them here, and the padding of the last chunk)."""
    gen = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(3 * torch.randn(512, vocab, generator=gen), -1)
    probs[torch.rand(512, vocab, generator=gen) < 0.3] = 0
    probs[:, 0] += (probs.sum(-1) == 0).float()  # (no row all zeros)
    probs[0] = 0
    probs[0, -1] = 1.0  # all the mass on the last token: the draw must reach the last chunk's end
    uniform = uniform_per_row(torch.arange(512) * 13 + 1, torch.arange(512))
    cdf = probs.double().cumsum(-1)
    expected = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None])[:, 0].clamp(max=vocab - 1)
    got = sample_from(probs, uniform)
    assert torch.equal(got, expected)
    assert (probs.gather(-1, got[:, None]) > 0).all()
