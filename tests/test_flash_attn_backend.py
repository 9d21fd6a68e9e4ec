"""The flash_attn backend's integration, on CPU, against a fake flash_attn module written in
PyTorch from flash-attn's documented interface (tests/fake_flash_attn)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers.backends.torch_ref import TorchBackend
from nanovllm.utils.context import Context

FAKE = os.path.join(os.path.dirname(__file__), "fake_flash_attn")
BLOCK = 256


def paged_step(q_lens, k_lens, heads=4, kv_heads=2, dim=32, num_blocks=12, seed=0):
    """Random q for each sequence's new tokens, and a paged cache already holding each sequence's
    whole context (the new tokens included), through shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // BLOCK) for n in k_lens)
    tables, next_block = [], 0
    for n in k_lens:
        used = -(-n // BLOCK)
        tables.append(perm[next_block:next_block + used] + [-1] * (width - used))
        next_block += used
    q = torch.randn(sum(q_lens), heads, dim, generator=g)
    cu_q = torch.tensor([0] + q_lens).cumsum(0).tolist()
    cu_k = torch.tensor([0] + k_lens).cumsum(0).tolist()
    context = Context(cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32), cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
                      seq_lens_k=torch.tensor(k_lens, dtype=torch.int32), max_seqlen_q=max(q_lens),
                      max_seqlen_k=max(k_lens), block_tables=torch.tensor(tables, dtype=torch.int32),
                      decode_only=all(n == 1 for n in q_lens), cu_seqlens_q_cpu=cu_q, seq_lens_k_cpu=k_lens)
    return q, k_cache, v_cache, context


@pytest.mark.parametrize("q_lens, k_lens, expected_call", [
    ([1, 1, 1], [1, 256, 700], "flash_attn_with_kvcache"),        # decode only
    ([1, 40, 300], [500, 40, 557], "flash_attn_varlen_func"),    # decode + fresh + chunk over a prefix
])
def test_paged_matches_torch_reference(fake_flash_attn, q_lens, k_lens, expected_call):
    module, backend = fake_flash_attn
    q, k_cache, v_cache, context = paged_step(q_lens, k_lens)
    out = backend.forward(q, None, None, k_cache, v_cache, context, 0.125)
    ref = TorchBackend.forward(q, None, None, k_cache, v_cache, context, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert module.CALLS == [expected_call]


def test_fresh_prefill_matches_torch_reference(fake_flash_attn):
    module, backend = fake_flash_attn
    g = torch.Generator().manual_seed(1)
    lens = [5, 1, 33]
    q, k, v = (torch.randn(sum(lens), h, 16, generator=g) for h in (4, 1, 1))
    cu = torch.tensor([0] + lens).cumsum(0).tolist()
    context = Context(cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), cu_seqlens_k=torch.tensor(cu, dtype=torch.int32),
                      seq_lens_k=torch.tensor(lens, dtype=torch.int32), max_seqlen_q=33, max_seqlen_k=33,
                      cu_seqlens_q_cpu=cu, seq_lens_k_cpu=lens)
    out = backend.forward(q, k, v, None, None, context, 0.25)
    torch.testing.assert_close(out, TorchBackend.forward(q, k, v, None, None, context, 0.25), atol=1e-5, rtol=1e-5)
    assert module.CALLS == ["flash_attn_varlen_func"]


def test_engine_with_flash_attn_matches_hf(fake_flash_attn, model_dir, prompts, reference):
    module, _ = fake_flash_attn
    llm = LLM(model_dir, attention_backend="flash_attn", max_model_len=400, max_num_batched_tokens=128)
    assert llm.config.block_size == 256  # the default for flash-attn's pages
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [reference(model_dir, p, 16) for p in prompts]
    assert {"flash_attn_varlen_func", "flash_attn_with_kvcache"} <= set(module.CALLS)


def test_flash_attn_needs_pages_of_256(fake_flash_attn, model_dir):
    with pytest.raises(ValueError, match="multiple of 256"):
        LLM(model_dir, attention_backend="flash_attn", kvcache_block_size=16)


def test_unavailable_backend_is_a_clear_error(model_dir):
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("the real flash_attn is installed here: nothing to refuse")
    with pytest.raises(ValueError, match="attention_backend='flash_attn' is not available"):
        LLM(model_dir, attention_backend="flash_attn")


def test_fp8_kv_cache_is_refused(fake_flash_attn, model_dir):
    """flash-attn's paged kernels read K/V in the query's dtype only: an fp8 cache with our
    per-layer scales is a clear error at start-up, naming what works instead."""
    with pytest.raises(ValueError, match="cannot read an fp8 KV cache.*'triton' or 'torch', or kv_cache_dtype='auto'"):
        LLM(model_dir, attention_backend="flash_attn", kv_cache_dtype="fp8")


# In a fresh interpreter (this one's Triton mode is whatever an earlier test picked): the backend
# get_backend gives for CUDA and for CPU, and which elementwise kernels each hands the model.
SELECTION = """
import json, sys
from nanovllm.layers.backends import get_backend
from nanovllm.layers.backends.flash_attn import FlashAttnBackend
try:
    cuda = get_backend("flash_attn", "cuda")
except ValueError as e:
    print(json.dumps({"error": str(e)})); sys.exit()
from nanovllm.layers import fused_triton
print(json.dumps({"fused": cuda.elementwise is fused_triton, "subclass": issubclass(cuda, FlashAttnBackend),
                  "same_forward": cuda.forward is FlashAttnBackend.forward, "cached": get_backend("flash_attn", "cuda") is cuda,
                  "kind": type(fused_triton._rms_norm_kernel).__name__,
                  "cpu_unfused": get_backend("flash_attn", "cpu").elementwise is None}))
"""


def backend_selection(interpret: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([FAKE, os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
        code = "import triton\n" + SELECTION  # (the interpreter picked before the backend asks)
    else:
        code = SELECTION
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_flash_attn_on_cuda_runs_the_fused_elementwise_kernels():
    """On CUDA the flash-attn path hands the model the compiled fused RMSNorm, SiLU-and-mul and
    q/k-norm + RoPE kernels (the Triton backend's), its attention unchanged; on CPU PyTorch's ops."""
    pytest.importorskip("triton", reason="triton is not installed")
    got = backend_selection(interpret=False)
    assert got == {"fused": True, "subclass": True, "same_forward": True, "cached": True, "kind": "JITFunction",
                   "cpu_unfused": True}


def test_flash_attn_on_cuda_in_an_interpreted_process_is_a_clear_error():
    pytest.importorskip("triton", reason="triton is not installed")
    got = backend_selection(interpret=True)
    assert "attention_backend='flash_attn' on device='cuda' needs compiled Triton kernels" in got["error"]
