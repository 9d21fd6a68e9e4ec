"""GPU tier (`-m gpu`; skipped without CUDA): bf16 against Hugging Face, CUDA graphs against eager
decode, and every installed backend against the torch reference, on the device."""
import importlib.util
import math

import pytest
import torch

import test_host_tier
from nanovllm import LLM, SamplingParams
from nanovllm.utils.tiny_model import (build_model, dequantize_checkpoint, fake_quantize_per_channel,
                                       quantize_checkpoint)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU_BACKENDS = [b for b in ("triton", "flash_attn") if importlib.util.find_spec(b) is not None]
# bf16 changes logits by ~1e-2 relative, enough to flip near-ties of a random model (and another
# attention kernel rounds differently from Hugging Face's SDPA): the first greedy token of every
# prompt must be Hugging Face's (bf16, same device) or, where it is not, a near-tie there, within
# NEAR_TIE of the largest |logit| of Hugging Face's first token; and, on average, at least 60% of the
# first 16 tokens agree before the first divergence.
NEAR_TIE = 0.02
MIN_MEAN_AGREEMENT = 0.6


def agreement(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n / len(a)


@torch.inference_mode()
def hf_bf16_greedy(path, prompt, n):
    """Hugging Face's greedy tokens, and the logits of its first one (float32)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), out.logits[0][0].float()


def first_tokens_off_hf(outputs, refs):
    """(prompt, ours, HF's, HF's logit gap between them, the gap allowed) where the first tokens differ."""
    off = []
    for i, (o, (tokens, logits)) in enumerate(zip(outputs, refs)):
        ours, theirs = o["token_ids"][0], tokens[0]
        if ours != theirs:
            off.append((i, ours, theirs, round((logits[theirs] - logits[ours]).item(), 4),
                        round(NEAR_TIE * logits.abs().max().item(), 4)))
    return off


@pytest.mark.parametrize("backend", GPU_BACKENDS + ["torch"])
def test_bf16_greedy_close_to_hf(model_dir, prompts, backend):
    llm = LLM(model_dir, dtype="bfloat16", attention_backend=backend, max_model_len=512,
              gpu_memory_utilization=0.3)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    refs = [hf_bf16_greedy(model_dir, p, 16) for p in prompts]
    scores = [agreement(o["token_ids"], r) for o, (r, _) in zip(outputs, refs)]
    off = first_tokens_off_hf(outputs, refs)
    assert all(gap <= allowed for *_, gap, allowed in off), f"(prompt, ours, HF's, gap, allowed): {off}"
    assert sum(scores) / len(scores) >= MIN_MEAN_AGREEMENT, (scores, off)
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


needs_triton = pytest.mark.skipif("triton" not in GPU_BACKENDS, reason="triton is not installed")


@needs_triton
def test_triton_decode_graph_replay_equals_eager_bitwise():
    """One bf16 decode step through TritonBackend with Qwen3-0.6B's heads: eagerly (5 rows, a block
    table as wide as the longest context) and replayed from a graph captured the way DecodeGraphs
    captures (8 padded rows, a max_model_len-wide table). Both split the KV alike: the same bits."""
    from nanovllm.engine.step_inputs import graph_batch_sizes, padded_batch_size
    from nanovllm.layers.backends.triton_attn import TritonBackend
    from nanovllm.utils.context import Context
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, max_model_len, num_blocks = 16, 8, 128, 16, 4096, 512
    lens = [1, 17, 300, 1000, 2500]
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, **bf16)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, **bf16)
    perm = torch.randperm(num_blocks).tolist()
    widths = [-(-n // block_size) for n in lens]
    tables = torch.full((len(lens), max(widths)), -1, dtype=torch.int32)
    for i, w in enumerate(widths):
        tables[i, :w] = torch.tensor([perm.pop() for _ in range(w)])
    q = torch.randn(len(lens), heads, head_dim, **bf16)
    size = padded_batch_size(len(lens), graph_batch_sizes(8))
    i32 = dict(dtype=torch.int32, device="cuda")
    eager = TritonBackend.forward(q, None, None, k_cache, v_cache, Context(
        cu_seqlens_q=torch.arange(len(lens) + 1, **i32), seq_lens_k=torch.tensor(lens, **i32), max_seqlen_q=1,
        block_tables=tables.cuda(), decode_only=True, padded_batch=size, max_model_len=max_model_len), 0.088)

    static_q = torch.zeros(size, heads, head_dim, **bf16)
    static_lens = torch.zeros(size, **i32)
    static_tables = torch.full((size, max_model_len // block_size), -1, **i32)
    context = Context(cu_seqlens_q=torch.arange(size + 1, **i32), seq_lens_k=static_lens, max_seqlen_q=1,
                      block_tables=static_tables, decode_only=True, padded_batch=size, max_model_len=max_model_len)
    forward = lambda: TritonBackend.forward(static_q, None, None, k_cache, v_cache, context, 0.088)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                     # warm up (compile) off the capture
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = forward()
    static_q[:len(lens)] = q
    static_lens[:len(lens)] = torch.tensor(lens, **i32)
    static_tables[:len(lens), :tables.shape[1]] = tables.cuda()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out[:len(lens)], eager)


@needs_triton
def test_graph_replay_equals_eager_forward_bitwise(model_dir, prompts):
    """Each decode step of 8 sequences (a captured size: the same GEMM shapes both ways) runs what
    the graph captured eagerly, then replays the graph: the same hidden-state bits. Needs the
    model runner to fill Context.padded_batch and max_model_len, as the captured contexts have them."""
    llm = LLM(model_dir, dtype="bfloat16", attention_backend="triton", max_model_len=512, max_num_seqs=8,
              gpu_memory_utilization=0.3)
    graphs, batches = llm.model_runner.graphs, []
    replay = graphs.replay

    def eager_then_replay(rows, positions, size, num_new=None):
        graphs.inputs[0, :size], graphs.inputs[1, :size] = rows, positions
        graphs.forward(size)
        eager = graphs.output[:size].clone()
        out = replay(rows, positions, size, num_new)
        batches.append(size)
        assert torch.equal(out, eager), f"batch {size}: max |diff| {(out.float() - eager.float()).abs().max()}"
        return out
    graphs.replay = eager_then_replay
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert batches == [8] * 5


@needs_triton
def test_graph_capture_runs_under_inference_mode(model_dir):
    """Warm-up and capture run under inference mode, as every step does (ModelRunner.launch)."""
    from nanovllm.engine.cuda_graphs import DecodeGraphs
    llm = LLM(model_dir, dtype="bfloat16", attention_backend="triton", max_model_len=512, max_num_seqs=4,
              enforce_eager=True, gpu_memory_utilization=0.3)
    runner, modes = llm.model_runner, []

    def model(input_ids, positions):
        modes.append(torch.is_inference_mode_enabled())
        return runner.model(input_ids, positions)
    config = llm.config
    for query_len in (1, 4):  # decode, and speculative decode with 3 drafts
        modes.clear()
        graphs = DecodeGraphs(model, runner.token_table, runner.block_tables, runner.block_size, runner.scratch_row,
                              4, config.max_model_len, config.hf_config.hidden_size, config.dtype, query_len=query_len)
        assert len(modes) == 2 * len(graphs.sizes) and all(modes)


@needs_triton
def test_speculative_decode_graphs_are_used_and_exact(model_dir, prompts):
    """With speculation the engine captures graphs of 1 + k query tokens too; a run replays them
    and gives plain decoding's greedy tokens (float32: the verification's multi-query attention
    and its GEMM shapes round differently from decode's, which bf16 would show as flipped ties)."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    chosen = [[11, 22, 33, 44, 55, 66, 77, 88] * 4] + prompts[:3]
    options = dict(dtype="float32", attention_backend="triton", max_model_len=512, max_num_seqs=8,
                   gpu_memory_utilization=0.3)
    expected = LLM(model_dir, **options).generate(chosen, params, use_tqdm=False)
    llm = LLM(model_dir, speculative_config={"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3},
              **options)
    graphs, sizes = llm.model_runner.verify_graphs, []
    replay = graphs.replay

    def counting(rows, positions, size, num_new=None):
        sizes.append(size)
        return replay(rows, positions, size, num_new)
    graphs.replay = counting
    got = llm.generate(chosen, params, use_tqdm=False)
    assert graphs.query_len == 4 and sizes
    assert [g["token_ids"] for g in got] == [e["token_ids"] for e in expected]


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


def test_graphs_fit_at_high_memory_utilization(tmp_path):
    """CUDA graphs are captured after the KV cache takes its share: the budget must already hold
    what capture needs (measured by a probe capture), or capture runs out of memory near 1."""
    path = build_model(str(tmp_path / "wide_kv_graphs"), num_hidden_layers=8, num_attention_heads=8,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=32768)
    torch.cuda.empty_cache()
    llm = LLM(path, max_model_len=32768, kvcache_block_size=256, gpu_memory_utilization=0.97, dtype="bfloat16",
              max_num_seqs=256)
    assert llm.model_runner.graphs is not None
    out = llm.generate([[1, 2, 3]] * 64, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o["token_ids"]) == 8 for o in out)
    free, total = torch.cuda.mem_get_info()
    assert free > 0.005 * total, "the engine took more than gpu_memory_utilization allows"
    del llm
    torch.cuda.empty_cache()


def test_bench_reports_gpu_idle_between_decode_steps():
    import os
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import bench
    result = bench.main(["--dummy", "qwen3-tiny", "--num-seqs", "32", "--min-input-len", "16", "--max-input-len", "64",
                         "--min-output-len", "32", "--max-output-len", "64", "--device", "cuda", "--max-model-len", "256"])
    idle = result["gpu_idle_between_decode_steps"]
    assert idle is not None and 0.0 <= idle < 1.0


def test_moe_on_the_gpu(tmp_path, prompts):
    """A tiny Qwen3-MoE on CUDA: the fused Triton experts in bf16 close to Hugging Face, and CUDA
    graph replay (which captures the kernel and its device-side alignment) equal to eager decode."""
    path = build_model(str(tmp_path / "moe"), arch="qwen3_moe", mlp_only_layers=[0])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(path, dtype="bfloat16", enforce_eager=eager, max_model_len=512, max_num_seqs=8,
                  gpu_memory_utilization=0.3)
        outs[eager] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
    refs = [hf_bf16_greedy(path, p, 16) for p in prompts]
    off = first_tokens_off_hf([{"token_ids": o} for o in outs[True]], refs)
    assert all(gap <= allowed for *_, gap, allowed in off), f"(prompt, ours, HF's, gap, allowed): {off}"
    scores = [agreement(o, r) for o, (r, _) in zip(outs[True], refs)]
    assert sum(scores) / len(scores) >= MIN_MEAN_AGREEMENT, (scores, off)


# A quantized model's GEMMs on the GPU (torch._scaled_mm, the Triton block-FP8 and AWQ kernels)
# against the same checkpoint's dequantized weights, both in bf16: mean KL (nats) of the
# next-token distributions over every prompt position. The fp8 kernels also quantize the
# activations (the dequantized run does not), AWQ's does not; bounds with room for bf16.
QUANTIZED_GPU_KL = {"fp8-online": 0.05, "fp8": 0.05, "awq": 0.01}


@pytest.mark.parametrize("scheme", ["fp8-online", "fp8", "awq"])
def test_quantized_gemms_on_the_gpu(tmp_path, prompts, scheme):
    base = build_model(str(tmp_path / "base"), hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=128, intermediate_size=256)
    if scheme == "fp8-online":
        path, options, reference = base, {"quantization": "fp8"}, fake_quantize_per_channel(base, str(tmp_path / "r"))
    else:
        path, options = quantize_checkpoint(base, str(tmp_path / scheme), scheme), {}
        reference = dequantize_checkpoint(path, str(tmp_path / "r"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=512)

    def run(folder, **kw):
        outs = {}
        for eager in (True, False):
            llm = LLM(folder, dtype="bfloat16", enforce_eager=eager, max_model_len=512, max_num_seqs=8,
                      gpu_memory_utilization=0.3, **kw)
            outs[eager] = llm.generate(prompts, params, use_tqdm=False)
            del llm
            torch.cuda.empty_cache()
        assert [o["token_ids"] for o in outs[True]] == [o["token_ids"] for o in outs[False]]  # graphs = eager
        return [pos for o in outs[True] for pos in o["prompt_logprobs"][1:]]

    got, expected = run(path, **options), run(reference)
    kl = [sum(math.exp(e[t]) * (e[t] - g[t]) for t in e) for g, e in zip(got, expected)]
    assert sum(kl) / len(kl) < QUANTIZED_GPU_KL[scheme], sum(kl) / len(kl)


def test_host_tier_reloads_on_the_copy_stream(model_dir):
    """The host tier on CUDA (pinned host pool, copy stream and events): a prefix reloaded from
    host memory gives the tokens and logprobs, bit for bit, of the same prefix served by the
    device tier (the same K/V), with CUDA graphs for decode."""
    common = dict(dtype="bfloat16", gpu_memory_utilization=0.3)
    reloaded, stats = test_host_tier.run_turns(model_dir, kv_offloading_size=test_host_tier.HOST_GIB, **test_host_tier.SMALL_DEVICE, **common)
    cached, _ = test_host_tier.run_turns(model_dir, **test_host_tier.LARGE_DEVICE, **common)
    assert stats["host_cache_hits"] == test_host_tier.ALL_HITS and stats["kv_copy_time_s"] >= 0
    assert [o["token_ids"] for o in reloaded] == [o["token_ids"] for o in cached]
    assert [o["logprobs"] for o in reloaded] == [o["logprobs"] for o in cached]
