"""GPU tier (`-m gpu`; skipped without CUDA): bf16 against Hugging Face, CUDA graphs against eager
decode, and every installed backend against the torch reference, on the device."""
import importlib.util

import pytest
import torch

from nanovllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU_BACKENDS = [b for b in ("triton", "flash_attn") if importlib.util.find_spec(b) is not None]
# bf16 changes logits by ~1e-2 relative, enough to flip near-ties of a random model: we require
# the first greedy token of every prompt to match Hugging Face's (bf16, same device) and, on
# average, at least 60% of the first 16 tokens to agree before the first divergence.
MIN_MEAN_AGREEMENT = 0.6


def agreement(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n / len(a)


@torch.inference_mode()
def hf_bf16_greedy(path, prompt, n):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", GPU_BACKENDS + ["torch"])
def test_bf16_greedy_close_to_hf(model_dir, prompts, backend):
    llm = LLM(model_dir, dtype="bfloat16", attention_backend=backend, max_model_len=512,
              gpu_memory_utilization=0.3)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    refs = [hf_bf16_greedy(model_dir, p, 16) for p in prompts]
    scores = [agreement(o["token_ids"], r) for o, r in zip(outputs, refs)]
    assert all(o["token_ids"][0] == r[0] for o, r in zip(outputs, refs))
    assert sum(scores) / len(scores) >= MIN_MEAN_AGREEMENT, scores
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("max_num_seqs", [8, 37])
def test_cuda_graph_decode_equals_eager(model_dir, prompts, backend, max_num_seqs):
    """Same kernels, same batch: graph replay must give exactly the eager tokens. 37 is not on the
    ladder's 16-grid: it checks the ladder ends at max_num_seqs."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(model_dir, dtype="bfloat16", attention_backend=backend, enforce_eager=eager, max_model_len=512,
                  max_num_seqs=max_num_seqs, gpu_memory_utilization=0.3)
        assert (llm.model_runner.graphs is None) == eager
        if not eager:
            assert llm.model_runner.graphs.sizes[-1] == max_num_seqs
        outs[eager] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_backend_greedy_equals_torch_backend_fp32(model_dir, prompts, reference, backend):
    """In float32 on the GPU every backend gives Hugging Face's CPU greedy tokens."""
    llm = LLM(model_dir, dtype="float32", attention_backend=backend, max_model_len=512, gpu_memory_utilization=0.3,
              max_num_batched_tokens=128)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    matches = [o["token_ids"] == reference(model_dir, p, 16) for o, p in zip(outputs, prompts)]
    assert sum(matches) >= len(prompts) - 1, matches  # TF32-free fp32 GEMMs still round differently from CPU


def test_kv_sizing_uses_gpu_memory_utilization(tmp_path):
    """KV blocks come from what gpu_memory_utilization leaves after the warm-up's peak. Blocks of
    8 MiB (8 layers x 8 KV heads x 128 dims x 256 tokens, K and V, bf16) keep the count below the
    max_num_seqs x max_model_len cap, so the budget decides."""
    from nanovllm.utils.tiny_model import build_model
    path = build_model(str(tmp_path / "wide_kv"), num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=32768)
    counts = []
    for utilization in (0.2, 0.4):
        llm = LLM(path, max_model_len=32768, kvcache_block_size=256, gpu_memory_utilization=utilization,
                  enforce_eager=True, dtype="bfloat16")
        counts.append(llm.stats()["num_blocks"])
        assert counts[-1] < llm.config.max_num_seqs * llm.config.max_blocks_per_seq
        del llm
        torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    block_bytes = 2 * 8 * 256 * 8 * 128 * 2
    # the extra 20% of the GPU goes to KV blocks, give or take the allocator's rounding
    assert abs((counts[1] - counts[0]) * block_bytes - 0.2 * total) < 0.02 * total
