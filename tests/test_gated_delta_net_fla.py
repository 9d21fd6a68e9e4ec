"""fla-core's kernels for Gated DeltaNet (layers/gated_delta_net_fla.py), which Qwen3.5 runs on
CUDA: each against the PyTorch reference, then a tiny Qwen3.5 on them equal to Hugging Face greedy
with chunked prefill, prefix-cache snapshots taken inside a chunk (the two-launch path) and on its
edge, and preemption. Without CUDA they run on CPU under Triton's interpreter, which needs two
shims of fla's code (the fixture below says which and why); the engine is made to pick them there."""
import builtins
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # (fla's kernels on CPU tensors: interpreted, set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("fla", reason="fla-core is not installed (pip install 'nanovllm[linear]')")

from hf_reference import assert_greedy_matches_hf  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.features import state_cache  # noqa: E402
from nanovllm.layers.gated_delta_net import GatedDeltaNet, causal_conv1d, chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule  # noqa: E402
from nanovllm.utils.triton_mode import import_kernels  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)  # (few: interpreted kernels are slow)
# two value heads per key head (fla's grouped value attention), half the head dims rotated
MODEL = ("qwen3_5", 1, dict(linear_num_key_heads=2, linear_num_value_heads=4))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def fla(monkeypatch):
    """fla's kernels importable for DEVICE, the engine's choice of kernels made theirs on any device;
    the module of layers/gated_delta_net_fla.py."""
    try:
        import_kernels("fla.ops.gated_delta_rule", DEVICE, "fla-core's Gated DeltaNet kernels")
    except ValueError as e:  # (this process's Triton runs in the other mode)
        pytest.skip(str(e))
    if DEVICE == "cpu":
        import triton.language as tl
        import triton.runtime.autotuner as autotuner
        import fla.ops.common.chunk_delta_h as chunk_delta_h
        # The interpreter has no device to time configs on, and runs a kernel's programs one by one:
        # "time" each config as the inverse of its block sizes' product, so that the fewest programs win.
        monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *args, config=None, **kwargs: [1.0 / math.prod(
            v for v in config.kwargs.values() if isinstance(v, int) and not isinstance(v, bool))] * 3)
        # chunk_delta_h's kernel calls .to() on a `for i_t in range(NT)` index, which compiled Triton
        # makes a tensor and the interpreter a Python int: its loop indices as interpreter scalars.
        monkeypatch.setattr(chunk_delta_h, "range", lambda *args: (tl.full((), i, tl.int32)
                                                                   for i in builtins.range(*map(int, args))),
                            raising=False)
    from nanovllm.layers import gated_delta_net_fla
    monkeypatch.setattr(state_cache, "delta_rule_kernels", lambda config, device: gated_delta_net_fla.FlaDeltaRule())
    return gated_delta_net_fla


def test_each_kernel_equals_the_pytorch_reference(fla):
    """Three sequences of 5, 70 (two delta-rule chunks) and 1 tokens, each from a random state:
    the convolution and the chunked rule (varlen), then one decode token each."""
    torch.manual_seed(0)
    hk, hv, dk, dv, width = 2, 4, 16, 8, 4
    cu = [0, 5, 75, 76]
    channels = 2 * hk * dk + hv * dv
    x, weight = torch.randn(76, channels, device=DEVICE), torch.randn(channels, width, device=DEVICE)
    conv_state = torch.randn(3, channels, width - 1, device=DEVICE)
    out, final = fla.causal_conv1d(x[None], weight, initial_state=F.pad(conv_state, (1, 0)), output_final_state=True,
                                   activation="silu", cu_seqlens=torch.tensor(cu, device=DEVICE))
    for i in range(3):
        ref, inputs = causal_conv1d(x[cu[i]:cu[i + 1]], conv_state[i], weight)
        torch.testing.assert_close(out[0, cu[i]:cu[i + 1]], ref)
        torch.testing.assert_close(final[i, :, 1:], inputs[:, -(width - 1):])
    step = torch.randn(3, channels, device=DEVICE)
    out, cache = fla.causal_conv1d_update(step, F.pad(conv_state, (1, 0)), weight=weight, activation="silu")
    inputs = torch.cat([conv_state, step[:, :, None]], -1)
    torch.testing.assert_close(out, F.silu((inputs * weight).sum(-1)))
    torch.testing.assert_close(cache[..., 1:], inputs[..., 1:])

    q, k = torch.randn(1, 76, hk, dk, device=DEVICE), torch.randn(1, 76, hk, dk, device=DEVICE)
    v = torch.randn(1, 76, hv, dv, device=DEVICE)
    g, beta = F.logsigmoid(torch.randn(1, 76, hv, device=DEVICE)), torch.rand(1, 76, hv, device=DEVICE)
    state = torch.randn(3, hv, dk, dv, device=DEVICE)
    out, final = fla.chunk_gated_delta_rule(q, k, v, g, beta, scale=dk ** -0.5, initial_state=state,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            cu_seqlens=torch.tensor(cu, device=DEVICE))
    # the reference's layout: [H, n, D], q and k normalized, q scaled, both repeated to the value heads
    to_ref = lambda t, scale=1.0: (l2norm(t) * scale).repeat_interleave(hv // hk, 1).transpose(0, 1)
    for i in range(3):
        span = slice(cu[i], cu[i + 1])
        ref, ref_state = chunk_gated_delta_rule(to_ref(q[0, span], dk ** -0.5), to_ref(k[0, span]),
                                                v[0, span].transpose(0, 1), g[0, span].t(), beta[0, span].t(), state[i])
        torch.testing.assert_close(out[0, span], ref.transpose(0, 1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final[i], ref_state, atol=1e-4, rtol=1e-4)
    out, final = fla.fused_recurrent_gated_delta_rule(q[0, :3, None], k[0, :3, None], v[0, :3, None],
                                                      g[0, :3, None], beta=beta[0, :3, None], scale=dk ** -0.5,
                                                      initial_state=state, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    unit = lambda t: l2norm(t).repeat_interleave(hv // hk, 1)
    ref, ref_state = recurrent_gated_delta_rule(unit(q[0, :3]) * dk ** -0.5, unit(k[0, :3]), v[0, :3], g[0, :3],
                                                beta[0, :3], state)
    torch.testing.assert_close(out[:, 0], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_state, atol=1e-5, rtol=1e-5)


def test_qwen3_5_on_fla_kernels_matches_hf(fla, tiny_models, prompts, reference):
    """Prompts of 1 to 80 tokens in 64-token steps of 16-token blocks: prefill chunks of one
    sequence and of several, decodes of several; the layers run fla's kernels."""
    path = tiny_models({"fla": MODEL}, "fla")
    with LLM(path, device=DEVICE, max_model_len=256, max_num_batched_tokens=64, kvcache_block_size=16,
             enforce_eager=True) as llm:
        layers = [m for m in llm.model_runner.model.modules() if isinstance(m, GatedDeltaNet)]
        assert layers and all(isinstance(m.kernels, fla.FlaDeltaRule) for m in layers)
        assert_greedy_matches_hf(llm, path, [p[:100] for p in prompts[:5]], reference, GREEDY)


def test_snapshots_inside_and_at_the_edge_of_a_chunk_resume_on_fla_kernels(fla, tiny_models, prompts, reference):
    """A 150-token prompt's snapshot at 144 falls inside its chunk [128, 150): the heads-and-tails
    launches; a 129-token prompt's at 128, the end of chunk [64, 128): one launch. Each repeated
    with more tokens resumes there and equals HF; two such prompts in one step take both at once."""
    path = tiny_models({"fla": MODEL}, "fla")
    with LLM(path, device=DEVICE, max_model_len=192, max_num_batched_tokens=64, kvcache_block_size=16,
             enforce_eager=True) as llm:
        for n in (150, 129):
            prompt = prompts[-1][:n]
            assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"] == reference(path, prompt, 6)
            longer = prompt + [1, 2, 3]
            out = llm.generate([longer], GREEDY, use_tqdm=False)[0]
            assert out["num_cached_tokens"] == (n - 1) // 16 * 16 and out["token_ids"] == reference(path, longer, 6)
        pair = [prompts[-2][:40], prompts[-3][:23]]  # snapshots at 32 and 16, both inside one 63-token step
        assert_greedy_matches_hf(llm, path, pair, reference, GREEDY)
        again = llm.generate([p + [4] for p in pair], GREEDY, use_tqdm=False)
        assert [o["num_cached_tokens"] for o in again] == [32, 16]
        assert [o["token_ids"] for o in again] == [reference(path, p + [4], 6) for p in pair]


def test_preemption_on_fla_kernels_recomputes_and_leaks_nothing(fla, tiny_models, prompts, reference):
    """Five prompts of two blocks each under a KV budget of 14 blocks: each needs a third as it
    decodes, so the engine preempts; output equals HF."""
    path = tiny_models({"fla": MODEL}, "fla")
    with LLM(path, device=DEVICE, max_model_len=192, kvcache_block_size=16, num_kvcache_blocks=14, max_num_seqs=8,
             enforce_eager=True) as llm:
        assert_greedy_matches_hf(llm, path, [p[:32] for p in prompts if len(p) >= 32], reference, GREEDY)
        assert llm.stats()["num_preemptions"] > 0


def test_the_engine_picks_fla_on_cuda_only_and_names_it_when_missing(monkeypatch, caplog):
    """delta_rule_kernels: the reference on CPU or with attention_backend='torch'; on CUDA fla's
    kernels, or the reference with a warning naming the extra when fla-core is not importable."""
    from types import SimpleNamespace
    from nanovllm.layers.gated_delta_net_fla import FlaDeltaRule
    pick = state_cache.delta_rule_kernels
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert pick(SimpleNamespace(attention_backend="triton"), cpu) is None
    assert pick(SimpleNamespace(attention_backend="torch"), cuda) is None
    assert isinstance(pick(SimpleNamespace(attention_backend="triton"), cuda), FlaDeltaRule)
    monkeypatch.setitem(sys.modules, "nanovllm.layers.gated_delta_net_fla", None)
    with caplog.at_level("WARNING", logger=state_cache.__name__):
        assert pick(SimpleNamespace(attention_backend="flash_attn"), cuda) is None
    assert "fla-core is not installed" in caplog.text and "nanovllm[linear]" in caplog.text
