"""Batch-invariant mode (features/batch_invariant.py): a sequence's tokens and logprobs are bitwise
the same alone, in a batch of 6 or 18 prompts of different lengths, and however its prompt is
chunked; greedy still equals Hugging Face; without the mode the same comparison differs here."""
import pickle
import random
import types

import pytest
import torch
import torch.nn.functional as F

from hf_reference import hf_greedy
from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.features import batch_invariant
from nanovllm.features.batch_invariant import (KEY_BLOCK, QUERY_TILE, check_supported, invariant_ops,
                                               invariant_runner, tiled_attention, tiled_linear)
from nanovllm.utils.tiny_model import build_model

MAX_TOKENS = 10
MAX_MODEL_LEN = 256


def mixed_prompts(count: int = 18) -> list[list[int]]:
    """The probe (37 tokens: more than two key blocks, so its prefill spans several tiles) and
    count - 1 others of 1 to 119 tokens."""
    rng = random.Random(0)
    lengths = [37] + [rng.randrange(1, 120) for _ in range(count - 1)]
    return [[rng.randrange(1, 512) for _ in range(n)] for n in lengths]


def seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=1000 + i, logprobs=5, max_tokens=MAX_TOKENS)


def probe_of(llm, prompts: list[list[int]]):
    """The first prompt's completion in this batch: its tokens and, per token, its logprob dict's
    items (floats: compared with ==, i.e. bitwise up to the sign of zero)."""
    out = llm.generate(prompts, [seeded(i) for i in range(len(prompts))], use_tqdm=False)[0]
    return out["token_ids"], [sorted(d.items()) for d in out["logprobs"]]


def alone_6_18_chunked(path: str, batch_invariant: bool, **options) -> list:
    """The probe alone, in a batch of 6, of 18, and alone with its prefill in chunks of 8 tokens."""
    prompts = mixed_prompts()
    with LLM(path, batch_invariant=batch_invariant, max_model_len=MAX_MODEL_LEN, **options) as llm:
        runs = [probe_of(llm, prompts[:1]), probe_of(llm, prompts[:6]), probe_of(llm, prompts)]
    # chunks of 8 tokens: the 37-token prompt is prefilled in 5 steps (the last of 5 tokens)
    with LLM(path, batch_invariant=batch_invariant, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=8,
             max_num_seqs=4, enable_prefix_caching=False, **options) as llm:
        runs.append(probe_of(llm, prompts[:1]))
    return runs


def test_alone_in_batches_and_chunked_bitwise_equal(model_dir):
    alone, batch6, batch18, chunked = alone_6_18_chunked(model_dir, True)
    assert len(alone[0]) == MAX_TOKENS
    assert batch6 == alone   # tokens, and every logprob float equal (==)
    assert batch18 == alone  # (the later runs also hit the prefix cache the first one left)
    assert chunked == alone


def test_without_the_mode_the_comparison_differs(model_dir):
    """So the test above can fail: on this CPU (torch 2.13, float32) F.linear's rows change bits with
    the row count, and SDPA's with the query length; at least one of the three runs differs in its
    logprobs (tokens may still agree). It is deterministic on a given CPU; were it not to differ on
    some other machine, a larger batch would show it."""
    alone, *others = alone_6_18_chunked(model_dir, False)
    assert any(other[1] != alone[1] for other in others)


def test_greedy_equals_hugging_face(model_dir):
    prompts = mixed_prompts(6)
    with LLM(model_dir, batch_invariant=True, max_model_len=MAX_MODEL_LEN) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]


def test_tensor_parallel_2(model_dir):
    """TP=2 workers build the invariant runner class from its pickled name (a fresh process)."""
    prompts = mixed_prompts(6)
    with LLM(model_dir, batch_invariant=True, tensor_parallel_size=2, max_model_len=MAX_MODEL_LEN) as llm:
        assert probe_of(llm, prompts) == probe_of(llm, prompts[:1])


def test_mixture_of_experts_on_cpu(tmp_path):
    """The CPU experts run through F.linear (layers/moe.py's torch_experts): invariant here too."""
    path = build_model(str(tmp_path), arch="qwen3_moe")
    prompts = mixed_prompts(6)
    with LLM(path, batch_invariant=True, max_model_len=MAX_MODEL_LEN) as llm:
        assert probe_of(llm, prompts) == probe_of(llm, prompts[:1])


def test_tiled_linear_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(70, 64), torch.randn(96, 64), torch.randn(96)
    full = tiled_linear(x, weight, bias)
    torch.testing.assert_close(full, F.linear(x, weight, bias))
    for rows in (1, 2, 3, 5, 17):  # row 0 alone, and among others, at every count: the same bits
        assert torch.equal(tiled_linear(x[:rows], weight, bias), full[:rows])
    assert tiled_linear(x[:0], weight).shape == (0, 96)
    assert tiled_linear(x.view(7, 10, 64), weight).shape == (7, 10, 96)


def test_tiled_attention_matches_sdpa_and_any_chunking():
    """A query's output is the same bits decoded alone (n = 1, no mask), in a causal prefill, or in
    a later chunk (a boolean mask): the forms torch_ref.attend uses."""
    torch.manual_seed(0)
    heads, kv_heads, length, dim = 4, 2, 2 * KEY_BLOCK + 5, 16
    q, k, v = torch.randn(heads, length, dim), torch.randn(kv_heads, length, dim), torch.randn(kv_heads, length, dim)
    full = tiled_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(full, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    for end in (1, QUERY_TILE + 3, length):  # the query at end - 1 as a decode step: its keys 0 .. end - 1
        alone = tiled_attention(q[:, end - 1:end], k[:, :end], v[:, :end], enable_gqa=True)
        assert torch.equal(alone, full[:, end - 1:end])
    start = KEY_BLOCK - 3  # a chunk of the last length - start queries over the whole context
    mask = torch.arange(length)[None, :] <= torch.arange(start, length)[:, None]
    assert torch.equal(tiled_attention(q[:, start:], k, v, attn_mask=mask, enable_gqa=True), full[:, start:])


def test_untiled_gemms_are_an_error_in_the_mode():
    with invariant_ops(), pytest.raises(RuntimeError, match="matmul"):
        torch.matmul(torch.ones(2, 3), torch.ones(3, 2))
    assert torch.matmul(torch.ones(2, 3), torch.ones(3, 2)).shape == (2, 2)  # (outside it: as ever)


def test_runner_class_pickles_by_reference():
    cls = invariant_runner(ModelRunner)
    assert invariant_runner(ModelRunner) is cls and issubclass(cls, ModelRunner)
    assert pickle.loads(pickle.dumps(cls)) is cls
    assert getattr(batch_invariant, cls.__qualname__) is cls  # (what a worker process's unpickling looks up)


class ChangedConfig:
    """A Config with some attributes changed, unchecked (check_supported reads attributes only)."""

    def __init__(self, config: Config, change: dict):
        self.config, self.change = config, change

    def __getattr__(self, name: str):
        return self.change[name] if name in self.change else getattr(self.config, name)


def test_unsupported_options_are_refused(model_dir, tmp_path):
    config = Config(model_dir, max_model_len=MAX_MODEL_LEN)
    check_supported(config)  # (the plain dense model on CPU: supported)
    for change, words in [({"attention_backend": "flash_attn"}, "flash_attn"),
                          ({"quant_config": object()}, "quantized weights"),
                          ({"speculative": object()}, "speculative decoding"),
                          ({"tensor_parallel_size": 4}, "tensor_parallel_size=4"),
                          ({"device": "cuda", "hf_config": types.SimpleNamespace(
                              **vars(config.hf_config), num_experts=4)}, "mixture of experts on CUDA")]:
        with pytest.raises(ValueError, match=words):
            check_supported(ChangedConfig(config, change))
    gemma = build_model(str(tmp_path), arch="gemma3")  # layers of several kinds (sliding windows)
    with pytest.raises(ValueError, match="layers of other kinds"):
        LLM(gemma, batch_invariant=True, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="speculative decoding"):
        LLM(model_dir, batch_invariant=True, max_model_len=MAX_MODEL_LEN,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
