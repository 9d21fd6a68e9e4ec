"""End to end on CPU in float32: greedy output must equal Hugging Face's token for token."""
import json
import shutil

import pytest
import torch

from hf_reference import assert_greedy_matches_hf
from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
MAX_MODEL_LEN = 400


def make_llm(path, **kwargs):
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    return LLM(path, **kwargs)


def check_equal(llm, path, prompts, reference, params=GREEDY):
    outputs = assert_greedy_matches_hf(llm, path, prompts, reference, params)
    assert all(out["finish_reason"] == "length" for out in outputs)
    return outputs


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_batch_matches_hf(model_dir, prompts, reference, async_scheduling):
    llm = make_llm(model_dir, async_scheduling=async_scheduling)
    outputs = check_equal(llm, model_dir, prompts, reference)
    assert all(out["num_cached_tokens"] == 0 for out in outputs)
    tokenizer = llm.tokenizer
    assert outputs[0]["text"] == tokenizer.decode(outputs[0]["token_ids"], skip_special_tokens=True)


def test_tied_embeddings_and_mha(tied_model_dir, prompts, reference):
    check_equal(make_llm(tied_model_dir), tied_model_dir, prompts, reference)


@pytest.mark.parametrize("block_size", [1, 8, 16, 256])
def test_block_sizes(model_dir, prompts, reference, block_size):
    check_equal(make_llm(model_dir, kvcache_block_size=block_size), model_dir, prompts, reference)


def test_chunked_prefill(model_dir, prompts, reference):
    llm = make_llm(model_dir, max_num_batched_tokens=64)
    assert max(map(len, prompts)) > 64
    check_equal(llm, model_dir, prompts, reference)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_preemption_under_tiny_kv_budget(model_dir, prompts, reference, async_scheduling):
    # 25 blocks of 16 tokens hold one max_model_len sequence; 8 prompts must take turns.
    llm = make_llm(model_dir, num_kvcache_blocks=25, kvcache_block_size=16, async_scheduling=async_scheduling)
    check_equal(llm, model_dir, prompts, reference)
    assert llm.stats()["num_preemptions"] > 0


def test_prefix_caching(model_dir, reference):
    shared = list(range(3, 203))  # 200 tokens: 12 full blocks of 16
    prompts = [shared + [7 + i] * (i + 1) for i in range(4)]
    llm = make_llm(model_dir)
    first = check_equal(llm, model_dir, prompts[:1], reference)
    assert first[0]["num_cached_tokens"] == 0
    later = check_equal(llm, model_dir, prompts[1:], reference)
    assert all(out["num_cached_tokens"] == 192 for out in later)
    assert llm.stats()["num_cached_tokens"] == 3 * 192
    # an identical prompt reuses all its full blocks but still computes its last token
    again = check_equal(llm, model_dir, prompts[:1], reference)
    assert again[0]["num_cached_tokens"] == 192


def test_prefix_caching_within_one_call(model_dir, reference):
    shared = list(range(50, 250))
    prompts = [shared + [9, i] for i in range(4)]
    # one prompt per step: each later request finds the blocks its predecessor filled
    llm = make_llm(model_dir, max_num_batched_tokens=202)
    outputs = check_equal(llm, model_dir, prompts, reference)
    assert all(out["num_cached_tokens"] > 0 for out in outputs[1:])


def test_prefix_caching_disabled(model_dir, reference):
    shared = list(range(3, 203))
    prompts = [shared + [1], shared + [2]]
    llm = make_llm(model_dir, enable_prefix_caching=False)
    check_equal(llm, model_dir, prompts[:1], reference)
    outputs = check_equal(llm, model_dir, prompts[1:], reference)
    assert outputs[0]["num_cached_tokens"] == 0 and llm.stats()["num_cached_tokens"] == 0


def test_stop_on_eos(model_dir, prompts, reference, tmp_path):
    expected = reference(model_dir, prompts[3], 32)
    eos = expected[5]
    cut = expected.index(eos)
    folder = tmp_path / "eos_model"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(config))
    llm = make_llm(str(folder))
    stop, ignore = llm.generate([prompts[3]] * 2, [SamplingParams(temperature=0, max_tokens=32),
                                                   GREEDY], use_tqdm=False)
    assert stop["finish_reason"] == "stop" and stop["token_ids"] == expected[:cut + 1]
    assert ignore["finish_reason"] == "length" and ignore["token_ids"] == expected


def test_eos_ids_of_generation_config(model_dir, prompts, reference, tmp_path):
    """Instruct checkpoints list more EOS ids in generation_config.json (Qwen's <|im_end|> besides
    <|endoftext|>); HF's generate stops at any of them, and so must we, at the union of both files."""
    from transformers import AutoModelForCausalLM
    expected = reference(model_dir, prompts[3], 32)
    eos = expected[4]  # the 5th greedy token
    cut = expected.index(eos)
    folder = tmp_path / "gen_eos_model"
    shutil.copytree(model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, eos]}))
    hf = AutoModelForCausalLM.from_pretrained(str(folder))
    ids = torch.tensor([prompts[3]])
    hf_out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                         pad_token_id=0)[0, len(prompts[3]):].tolist()
    assert hf_out == expected[:cut + 1]
    out = make_llm(str(folder)).generate([prompts[3]], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert out[0]["token_ids"] == hf_out and out[0]["finish_reason"] == "stop"


def test_string_prompts_and_single_prompt(model_dir, reference):
    llm = make_llm(model_dir)
    text = "The quick brown fox"
    ids = llm.tokenizer.encode(text)
    [out] = llm.generate(text, GREEDY, use_tqdm=False)
    assert out["token_ids"] == reference(model_dir, ids, 32)
    [out_ids] = llm.generate(ids, GREEDY, use_tqdm=False)
    assert (out_ids["token_ids"], out_ids["text"]) == (out["token_ids"], out["text"])


def test_model_without_tokenizer(tmp_path, reference):
    from nanovllm.utils.tiny_model import build_model
    path = build_model(str(tmp_path / "no_tok"), tokenizer=False, seed=3)
    llm = make_llm(path)
    [out] = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert out["text"] is None and out["token_ids"] == reference(path, [5, 6, 7], 32)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", GREEDY, use_tqdm=False)


def test_sampling_controls(model_dir, prompts):
    llm = make_llm(model_dir)
    greedy = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    top1 = llm.generate(prompts[:3], SamplingParams(temperature=1.0, top_k=1, max_tokens=32, ignore_eos=True),
                        use_tqdm=False)
    tiny_p = llm.generate(prompts[:3], SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=32, ignore_eos=True),
                          use_tqdm=False)
    assert [o["token_ids"] for o in top1] == [o["token_ids"] for o in greedy]
    assert [o["token_ids"] for o in tiny_p] == [o["token_ids"] for o in greedy]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=32, ignore_eos=True)
    alone = llm.generate([prompts[2]], seeded, use_tqdm=False)[0]["token_ids"]
    others = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)] * 7
    batch = llm.generate(prompts[:7] + [prompts[2]], others + [seeded], use_tqdm=False)
    assert batch[-1]["token_ids"] == alone
    other_seed = llm.generate([prompts[2]], SamplingParams(temperature=1.0, seed=99, max_tokens=32, ignore_eos=True),
                              use_tqdm=False)[0]["token_ids"]
    assert other_seed != alone
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_seeded_sampling_noise_is_a_function_of_seed_and_position(model_dir, prompts):
    """A seeded request draws the same tokens however its prompt is computed: in one step or in
    chunks, or with its full blocks from the prefix cache. And its k-th token is the first token
    of the same request for its prompt + its first k-1 tokens: the noise of a sampled token is a
    function of (seed, that token's position) only, never of where the step's chunk started."""
    prompt = prompts[5]                                   # 150 tokens
    seeded = dict(temperature=1.0, seed=4321, ignore_eos=True)
    params = SamplingParams(max_tokens=8, **seeded)
    one_step = make_llm(model_dir)
    [first] = one_step.generate([prompt], params, use_tqdm=False)
    ids = first["token_ids"]
    [cached] = one_step.generate([prompt], params, use_tqdm=False)
    assert cached["num_cached_tokens"] > 0 and cached["token_ids"] == ids
    chunked = make_llm(model_dir, max_num_batched_tokens=64, enable_prefix_caching=False)  # 64 + 64 + 22
    [in_chunks] = chunked.generate([prompt], params, use_tqdm=False)
    assert in_chunks["token_ids"] == ids
    for k in (2, 5, 8):
        [out] = chunked.generate([prompt + ids[:k - 1]], SamplingParams(max_tokens=1, **seeded), use_tqdm=False)
        assert out["token_ids"] == [ids[k - 1]], f"token {k}"
    assert len(set(ids)) > 1, "a sampled run that repeats one token would not show the positions"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_says_whether_the_text_has_them(model_dir, skip):
    """SamplingParams.skip_special_tokens (vLLM's; gpt-oss's harmony markers are special tokens):
    the end-of-text token, forced three times, is in the text (generate's and a stream's) or not."""
    llm = make_llm(model_dir)
    eos = llm.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    params = SamplingParams(max_tokens=3, ignore_eos=True, allowed_token_ids=[eos], skip_special_tokens=skip)
    [out] = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    streamed = "".join(update["text"] or "" for update in llm.stream([[5, 6, 7]], params))
    assert out["token_ids"] == [eos] * 3
    assert out["text"] == streamed == ("" if skip else "<|endoftext|>" * 3)
