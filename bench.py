"""Throughput and latency benchmark, with Hugging Face transformers measured in the same run.

    python bench.py                                  # the standard workload (below) on Qwen3-0.6B
    python bench.py --dummy qwen3-tiny --num-seqs 16 --max-input-len 64 --max-output-len 32 --compare hf

The standard workload is nano-vllm's: random.Random(seed=0); 256 prompts of randint(100, 1024)
token ids, each randint(0, 10000); then randint(100, 1024) max_tokens per request;
temperature 0.6, ignore_eos. It asks for exactly 133,966 output tokens.
Without --model, ~/huggingface/Qwen3-0.6B is used when it exists, else random weights of its
exact shape (throughput does not depend on the weight values). Machines are noisy: compare
engines by the ratio measured in one run.
"""
import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.engine.step_inputs import MAX_GRAPH_BATCH, graph_batch_sizes, padded_batch_size
from nanovllm.features.recorder import StepRecorder
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.moe import FusedExperts

# Model shapes for --dummy: random weights, no files needed.
PRESETS = {
    # Qwen3-0.6B exactly (its config.json), bf16
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="bfloat16"),
    # small enough for a CPU smoke run
    "qwen3-tiny": dict(vocab_size=16384, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32"),
    # Qwen3-30B-A3B exactly (its config.json), bf16: 128 experts, 8 per token; ~61 GB of weights
    "qwen3-30b-a3b": dict(architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, dtype="bfloat16"),
    # its shape at toy size, for a CPU smoke run of a mixture of experts
    "qwen3-moe-tiny": dict(architecture="Qwen3MoeForCausalLM", vocab_size=16384, hidden_size=256,
                           intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
                           num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=4096,
                           rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32"),
    # Gemma 3 1B exactly (google/gemma-3-1b-it's config.json), bf16: 5 local layers (window 512) to 1 global.
    # (its sliding-window layers hold their window alone: features/window_blocks.py)
    "gemma-3-1b": dict(architecture="Gemma3ForCausalLM", config_class="Gemma3TextConfig", vocab_size=262144,
                       hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                       num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                       sliding_window_pattern=6, max_position_embeddings=32768, rms_norm_eps=1e-6,
                       rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                       tie_word_embeddings=True, dtype="bfloat16"),
    # its shape at toy size (window 64, one global layer of 3), for a CPU smoke run
    "gemma3-tiny": dict(architecture="Gemma3ForCausalLM", config_class="Gemma3TextConfig", vocab_size=16384,
                        hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=64,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32"),
    # Qwen3.5 0.8B's text model (Qwen/Qwen3.5-0.8B's text_config), bf16: 24 layers, every fourth full attention
    # (8 heads, 2 KV heads of 256, a quarter of each rotated), the others Gated DeltaNet (16 key and 16 value
    # heads of 128); its recurrent states take ~19 MiB a slot (features/state_cache.py)
    "qwen3.5-0.8b": dict(architecture="Qwen3_5ForCausalLM", config_class="Qwen3_5TextConfig", vocab_size=248320,
                         hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                         linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                         max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                          "partial_rotary_factor": 0.25}, dtype="bfloat16"),
    # its shape at toy size (3 linear-attention layers, 1 full), for a CPU smoke run
    "qwen3.5-tiny": dict(architecture="Qwen3_5ForCausalLM", config_class="Qwen3_5TextConfig", vocab_size=16384,
                         hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32"),
    # gpt-oss-20b (openai/gpt-oss-20b's config.json), its experts in bf16 (the checkpoint's MXFP4 is dequantized
    # at load: ~38 GB for the 24 layers' 32 experts), sliding-window (128) and full layers alternating, sinks
    # (attention on the triton and torch backends: layers/attention_sinks.py)
    "gpt-oss-20b": dict(architecture="GptOssForCausalLM", config_class="GptOssConfig", vocab_size=201088,
                        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                        sliding_window=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 4096}, dtype="bfloat16"),
    # its shape at toy size (a sliding and a full layer, 4 experts), for a CPU smoke run
    "gpt-oss-tiny": dict(architecture="GptOssForCausalLM", config_class="GptOssConfig", vocab_size=16384,
                         hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                         sliding_window=64, max_position_embeddings=4096, dtype="float32"),
    # Qwen2.5-VL 3B (Qwen/Qwen2.5-VL-3B-Instruct's config.json), bf16: the text model and the vision tower
    # (32 blocks, window attention); its image processor's defaults (14-pixel patches, 2 x 2 merged)
    "qwen2.5-vl-3b": dict(architecture="Qwen2_5_VLForConditionalGeneration", config_class="Qwen2_5_VLConfig",
                          text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                                           num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                                           max_position_embeddings=128000, rms_norm_eps=1e-6,
                                           tie_word_embeddings=True, rope_parameters={
                                               "rope_type": "default", "rope_theta": 1000000.0,
                                               "mrope_section": [16, 24, 24]}),
                          vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                             out_hidden_size=2048, patch_size=14, window_size=112,
                                             fullatt_block_indexes=[7, 15, 23, 31], spatial_merge_size=2,
                                             temporal_patch_size=2, hidden_act="silu"),
                          image_token_id=151655, vision_start_token_id=151652, vision_end_token_id=151653,
                          image_processor=dict(patch_size=14, merge_size=2, temporal_patch_size=2),
                          dtype="bfloat16"),
    # its shape at toy size, for a CPU smoke run of image input
    "qwen2.5-vl-tiny": dict(architecture="Qwen2_5_VLForConditionalGeneration", config_class="Qwen2_5_VLConfig",
                            text_config=dict(vocab_size=16384, hidden_size=256, intermediate_size=512,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=4096, rms_norm_eps=1e-6,
                                             tie_word_embeddings=True, rope_parameters={
                                                 "rope_type": "default", "rope_theta": 1000000.0,
                                                 "mrope_section": [8, 12, 12]}),
                            vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                                               out_hidden_size=256, patch_size=14, window_size=112,
                                               fullatt_block_indexes=[1], spatial_merge_size=2,
                                               temporal_patch_size=2, hidden_act="silu"),
                            image_token_id=16000, vision_start_token_id=16001, vision_end_token_id=16002,
                            image_processor=dict(patch_size=14, merge_size=2, temporal_patch_size=2),
                            dtype="float32"),
}
# Quantized shapes: each preset above as a block-quantized FP8 checkpoint (Qwen3-*-FP8's config)
# and an AWQ int4 one (Qwen3-*-AWQ's); their dummy weights are random codes and scales.
QUANTIZATION_CONFIGS = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True},
}
for _name in ("qwen3-0.6b", "qwen3-tiny"):
    for _method, _config in QUANTIZATION_CONFIGS.items():
        PRESETS[f"{_name}-{_method}"] = dict(PRESETS[_name], quantization_config=_config)
DEFAULT_MODEL = os.path.expanduser("~/huggingface/Qwen3-0.6B")
MAX_TOKEN_ID = 10000  # prompt token ids are drawn from [0, MAX_TOKEN_ID]
# Warm-up prompts repeat one token id: no workload prompt starts with a run of one id a block long,
# so nothing the warm-up leaves in the prefix cache is ever a hit in the timed run.
WARMUP_TOKEN = 1


def make_workload(num_seqs=256, min_input_len=100, max_input_len=1024, min_output_len=100, max_output_len=1024,
                  seed=0, vocab_size=None):
    """Prompts (token id lists) and max_tokens per request, drawn in nano-vllm's order."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, MAX_TOKEN_ID) for _ in range(rng.randint(min_input_len, max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [rng.randint(min_output_len, max_output_len) for _ in range(num_seqs)]
    if vocab_size is not None and vocab_size <= MAX_TOKEN_ID:  # after drawing: the stream stays the same
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return prompts, max_tokens


def dummy_draft(speculative_config: str | None) -> str | None:
    """--speculative-config with a draft "model": "dummy:PRESET" (random weights of that preset's
    shape; the target's preset gives the target's weights) as a folder the engine can read."""
    if speculative_config is None:
        return None
    config = json.loads(speculative_config)
    model = config.get("model")
    if isinstance(model, str) and model.startswith("dummy:"):
        if model[len("dummy:"):] not in PRESETS:
            raise SystemExit(f"--speculative-config: unknown preset {model!r}; presets: {sorted(PRESETS)}")
        config["model"] = write_dummy_config(model[len("dummy:"):])
    return json.dumps(config)


def write_dummy_config(preset: str) -> str:
    import transformers
    settings = dict(PRESETS[preset])
    architecture = settings.pop("architecture", "Qwen3ForCausalLM")
    config_class = settings.pop("config_class", architecture.replace("ForCausalLM", "Config"))
    image_processor = settings.pop("image_processor", None)
    path = tempfile.mkdtemp(prefix=f"nanovllm-{preset}-")
    config = getattr(transformers, config_class)(**settings)
    config.architectures = [architecture]
    config.save_pretrained(path)
    if image_processor is not None:  # (a vision-language preset: its PIL image processor beside it)
        transformers.Qwen2VLImageProcessorPil(**image_processor).save_pretrained(path)
    return path


def image_requests(path: str, prompts: list[list[int]], num_images: int, size: int, seed: int):
    """The first num_images prompts with a random size x size image each before their text (the
    placeholder between the vision start and end tokens); (requests, their prompt tokens, images expanded)."""
    import numpy as np
    from PIL import Image
    from transformers import AutoConfig
    from nanovllm.features.multimodal import image_processing
    config, rng = AutoConfig.from_pretrained(path), np.random.default_rng(seed)
    requests, lengths = list(prompts), list(map(len, prompts))
    for i in range(min(num_images, len(prompts))):
        image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
        ids = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id] + prompts[i]
        requests[i] = {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}
        lengths[i] = len(ids) - 1 + image_processing(path).image(image, 0).length
    return requests, lengths


def weight_bytes(model) -> dict[str, int]:
    """Bytes of the model's parameters (rank 0's), all of them and its linear layers' and experts'
    (the ones quantization shrinks)."""
    def size(params):
        return sum(p.numel() * p.element_size() for p in params)
    linear = [p for m in model.modules() if isinstance(m, (LinearBase, FusedExperts))
              for p in m.parameters(recurse=False)]
    return {"all": size(model.parameters()), "linear": size(linear)}


def percentiles(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    pick = lambda q: values[min(len(values) - 1, round(q * (len(values) - 1)))]  # noqa: E731
    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99)}


# The probe (--probe-save, --probe-check): the logprobs a model gives every prompt token of a fixed
# set after the first, run after the timed run. Its steps' GEMMs have 16, 96 and 800 rows (given
# max_num_seqs >= 48): decode tiles, the 64-row ones, prefill tiles (2-token prompts take the
# multi-query decode kernel); each is checked apart, so that a fault in one is not diluted.
PROBE_STEPS = {"16 rows": ((8, 2),) * 4, "96 rows": ((48, 2),), "800 rows": ((4, 200),)}  # (prompts, tokens)
PROBE_SEED = 1


def probe_logprobs(llm, vocab_size: int) -> dict[str, list[float]]:
    rng = random.Random(PROBE_SEED)
    probe = {}
    for name, batches in PROBE_STEPS.items():
        values = probe[name] = []
        for count, length in batches:
            prompts = [[rng.randint(WARMUP_TOKEN + 2, min(MAX_TOKEN_ID, vocab_size - 1)) for _ in range(length)]
                       for _ in range(count)]
            outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            values += [logprob for o in outputs for entry in o["prompt_logprobs"][1:] for logprob in entry.values()]
    return probe


def probe_error(probe: dict[str, list[float]], reference: dict[str, list[float]]) -> dict[str, float]:
    """Per probe step: |a - b| / |b| of the two models' logprobs, each centred on its mean (a shift
    of them all, log Z, is not an error: the weights decide their spread). NaN stays NaN."""
    if probe.keys() != reference.keys() or any(len(probe[k]) != len(reference[k]) for k in probe):
        raise ValueError(f"the reference probe is not this one: steps {sorted(reference)}, not {sorted(probe)}")
    errors = {}
    for name in probe:
        a, b = torch.tensor(probe[name], dtype=torch.float64), torch.tensor(reference[name], dtype=torch.float64)
        a, b = a - a.mean(), b - b.mean()
        errors[name] = float((a - b).norm() / b.norm())
    return errors


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def warm_up(llm, prompts):
    """Run every kernel variant the timed run over `prompts` will use, so that no Triton compile
    lands in it. Costs a few steps, plus one step's token budget when the run chunks prompts.
    1. a fresh prefill (no cached context), then a step mixing its decode with a prefill over the
       block it left in the prefix cache (the paged prefill kernel, as every mixed step uses);
    2. when the run's prompts exceed one step's budget: prompts that do too, so one is chunked;
    3. decode at every CUDA-graph ladder size up to the run's largest batch, largest first (eager
       decode picks its split-KV count, a kernel variant, from the padded batch size)."""
    config = llm.config
    budget, max_len, block = config.max_num_batched_tokens, config.max_model_len, config.block_size
    params = lambda n: SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True)  # noqa: E731
    generate = lambda prompts, p: llm.generate(prompts, p, use_tqdm=False)  # noqa: E731
    prefix = [WARMUP_TOKEN] * block
    if max_len >= block + 4:                                # prompts of a full block + 2 tokens, and 2 new ones
        llm.add_request(prefix + [0], params(2))
        llm.step()                                          # fresh prefill; publishes the full block
        llm.add_request(prefix + [0, 0], params(2))         # 2 uncached tokens: a prefill, not a decode row
        while not llm.is_finished():
            llm.step()
    else:
        generate([[WARMUP_TOKEN] * 2], params(2))
    if sum(map(len, prompts)) > budget:
        length = max_len - 2
        generate([[WARMUP_TOKEN + 1] * length] * min(budget // length + 1, config.max_num_seqs), params(2))
    ladder = graph_batch_sizes(min(config.max_num_seqs, MAX_GRAPH_BATCH))
    largest = padded_batch_size(min(len(prompts), config.max_num_seqs), ladder)
    sizes = [s for s in ladder if s <= largest]
    # sequence j samples 1 + #{sizes > j} tokens: decode step t runs the sizes[-t] sequences with j < sizes[-t]
    lengths = [min(1 + sum(s > j for s in sizes), max_len - 2) for j in range(largest)]
    generate([[WARMUP_TOKEN] * 2] * largest, [params(n) for n in lengths])


def draw_timeline(records: list[dict], num_blocks: int, path: str):
    """One picture of the run, step by step: continuous batching (sequences joining and leaving),
    prefill against decode tokens (with speculation, the drafts verified and the tokens out), KV
    blocks in use and the preemptions when they run out, and how much of each step the host spent
    outside the model."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--timeline needs matplotlib: pip install matplotlib (or the project's 'plot' extra)") from e
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    steps = range(len(records))
    col = lambda key: [r[key] for r in records]  # noqa: E731
    stages = "stage_busy" in records[0] if records else False  # (pipeline parallelism: a fifth panel)
    fig, axes = plt.subplots(4 + stages, 1, figsize=(10, 9 + 2 * stages), sharex=True)
    axes[0].plot(steps, col("num_seqs"), color="tab:blue")
    axes[0].set_ylabel("sequences\nin the step")
    axes[1].stackplot(steps, col("prefill_tokens"), col("decode_tokens"), labels=["prefill", "decode"],
                      colors=["tab:orange", "tab:green"])
    if any(r["draft_tokens"] for r in records):  # speculative decoding: what each step verified and kept
        axes[1].plot(steps, col("draft_tokens"), color="tab:red", linewidth=0.8, label="drafts verified")
        axes[1].plot(steps, col("emitted_tokens"), color="black", linewidth=0.8, label="tokens out")
    axes[1].set_ylabel("tokens")
    axes[1].legend(loc="upper right")
    axes[2].plot(steps, col("used_blocks"), color="tab:purple", label="in use")
    axes[2].axhline(num_blocks, color="gray", linestyle="--", label="all")
    preempted = [i for i, r in enumerate(records) if i and r["preemptions"] > records[i - 1]["preemptions"]]
    for i in preempted:
        axes[2].axvline(i, color="tab:red", alpha=0.3, linewidth=0.8)
    axes[2].set_ylabel("KV blocks")
    axes[2].legend(loc="lower left", title=f"{records[-1]['preemptions'] - records[0]['preemptions'] if records else 0}"
                   " preemptions (red)")
    axes[3].plot(steps, [r["step_s"] * 1e3 for r in records], color="tab:gray", label="step")
    axes[3].plot(steps, [r["host_s"] * 1e3 for r in records], color="tab:red", label="host")
    axes[3].set_ylabel("ms")
    axes[3].set_yscale("log")
    axes[3].legend(loc="upper right")
    if stages:  # each stage's share of its step spent working (the rest: waiting for the stage before)
        for stage, busy in enumerate(zip(*col("stage_busy"))):
            axes[4].plot(steps, [100 * b for b in busy], linewidth=0.8, label=f"stage {stage}")
        axes[4].set_ylabel("stage busy %")
        axes[4].set_ylim(0, 105)
        axes[4].legend(loc="lower right")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def pipeline_busy(llm, records: list[dict] | None) -> list[float]:
    """Each stage's busy share of the decode steps (stages.stage_busy), and into each timeline
    record its step's per stage (the ranks' steps are the engine's, one for one, from the attach)."""
    from nanovllm.distributed.pipeline import stage_times, time_stages
    from nanovllm.distributed.stages import stage_busy
    times = stage_times(llm.model_runner)
    time_stages(llm.model_runner, False)
    busy, over_decode = stage_busy(times, llm.config.tensor_parallel_size)
    if records is not None and len(records) == busy.shape[1]:
        for record, per_stage in zip(records, busy.T):
            record["stage_busy"] = per_stage.tolist()
    return over_decode


def run_nanovllm(args, path, prompts, max_tokens, prompt_lengths=None):
    llm = LLM(path, device=args.device, dtype=args.dtype, load_format="dummy" if args.dummy else "auto",
              # (never more rows than requests: each size of the CUDA-graph ladder up to it is captured)
              max_model_len=args.max_model_len, max_num_seqs=min(args.max_num_seqs, args.num_seqs),
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              attention_backend=args.attention_backend, tensor_parallel_size=args.tensor_parallel_size,
              pipeline_parallel_size=args.pipeline_parallel_size, num_kvcache_blocks=args.num_kvcache_blocks,
              async_scheduling=args.async_scheduling,
              speculative_config=args.speculative_config, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, batch_invariant=args.batch_invariant)
    weights = weight_bytes(llm.model_runner.model)
    warm_up(llm, [p if isinstance(p, list) else p["prompt_token_ids"] for p in prompts])  # not timed
    recorder = StepRecorder(llm.config.device, timeline=bool(args.timeline))
    llm.attach_recorder(recorder)
    if args.pipeline_parallel_size > 1:  # each rank's work and waits, step by step
        from nanovllm.distributed.pipeline import time_stages
        time_stages(llm.model_runner, True)
    before = dict(llm.stats())
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in max_tokens]
    sync(llm.config.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    sync(llm.config.device)
    elapsed = time.perf_counter() - start
    stats, delta = llm.stats(), recorder.totals
    output_tokens = sum(len(o["token_ids"]) for o in outputs)
    result = {
        "output_tokens": output_tokens, "elapsed_s": elapsed, "output_tok_per_s": output_tokens / elapsed,
        "total_tok_per_s": (output_tokens + sum(prompt_lengths or map(len, prompts))) / elapsed,
        "prefill_tok_per_s": delta["prefill_tokens"] / max(delta["prefill_time_s"], 1e-9),
        "decode_tok_per_s": delta["decode_tokens"] / max(delta["decode_time_s"], 1e-9),
        "ttft_s": percentiles(o["metrics"]["ttft_s"] for o in outputs),
        "tpot_s": percentiles(o["metrics"]["tpot_s"] for o in outputs),
        "device": llm.config.device, "attention_backend": llm.config.attention_backend,
        "batch_invariant": llm.config.batch_invariant,
        "num_preemptions": stats["num_preemptions"] - before["num_preemptions"],
        "gpu_idle_between_decode_steps": recorder.gpu_idle_fraction(),
        # per sequence: 1.0 without speculation, 1 / (tokens per verification) with it
        "target_forwards_per_output_token": delta["sampling_forwards"] / max(output_tokens, 1),
        "weight_bytes": weights["all"], "linear_weight_bytes": weights["linear"], "num_kv_blocks": stats["num_blocks"],
    }
    drafts, draft_tokens, accepted = (stats[k] - before[k] for k in ("spec_num_drafts", "spec_num_draft_tokens",
                                                                      "spec_num_accepted_tokens"))
    if args.speculative_config:  # vLLM's figures: accepted / drafted, and tokens per draft (1 + accepted / drafts)
        result["spec_acceptance_rate"] = accepted / max(draft_tokens, 1)
        result["spec_mean_acceptance_length"] = 1 + accepted / max(drafts, 1)
    if args.pipeline_parallel_size > 1:
        result["pipeline_stage_busy"] = pipeline_busy(llm, recorder.records)
    if args.timeline:
        draw_timeline(recorder.records, stats["num_blocks"], args.timeline)
        result["timeline"] = args.timeline
    if args.probe_save or args.probe_check:
        result["probe"] = probe_logprobs(llm, llm.config.hf_config.vocab_size)
    llm.shutdown()
    del llm
    return result


def hf_model(args, path, device):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    config = AutoConfig.from_pretrained(path)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    if args.dummy:  # random weights of the same shape
        model = auto.from_config(config, dtype=dtype)
    else:
        model = auto.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def hf_continuous(model, prompts, max_tokens, time_limit):
    """transformers' continuous batching manager, one max_new_tokens per request."""
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=True, temperature=0.6, eos_token_id=None, max_new_tokens=max(max_tokens))
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        start = time.perf_counter()
        for i, (p, n) in enumerate(zip(prompts, max_tokens)):
            manager.add_request(p, request_id=str(i), max_new_tokens=n)
        done, tokens, capped = 0, 0, False
        while done < len(prompts):
            if time.perf_counter() - start > time_limit:
                capped = True
                break
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
        return tokens, time.perf_counter() - start, capped, "continuous_batching"
    finally:
        manager.stop(block=True)


@torch.inference_mode()
def hf_static(model, prompts, max_tokens, batch_size, time_limit, device, show_progress):
    """Static batches through `generate`, left-padded; counts only the tokens each request asked
    for (a batch runs until its longest request is done), or, past time_limit, those generated
    (generate's max_time stops a batch there; the first one starts whatever the limit, and makes a
    token at least)."""
    from tqdm.auto import tqdm
    tokens, capped, start = 0, False, time.perf_counter()
    order = range(0, len(prompts), batch_size)
    for i in tqdm(order, desc="HF generate", disable=not show_progress):
        left = max(0.0, time_limit - (time.perf_counter() - start))
        if i > 0 and left == 0:
            capped = True
            break
        batch, wanted = prompts[i:i + batch_size], max_tokens[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=0.6, top_k=0, top_p=1.0,
                             max_new_tokens=max(wanted), min_new_tokens=max(wanted), eos_token_id=None, pad_token_id=0,
                             max_time=left if left != float("inf") else None)
        generated = out.shape[1] - width
        tokens += sum(min(n, generated) for n in wanted)
        if generated < max(wanted):  # (stopped by max_time)
            capped = True
            break
    sync(device)
    return tokens, time.perf_counter() - start, capped, f"generate, static batches of {batch_size}"


@torch.inference_mode()
def hf_images(model, path, requests, max_tokens, time_limit, device):
    """Requests with images through `generate`, one at a time (HF's processor's pixels, its M-RoPE)."""
    from transformers import AutoImageProcessor
    processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    image_id = model.config.image_token_id
    tokens, capped, start = 0, False, time.perf_counter()
    for request, n in zip(requests, max_tokens):
        if time.perf_counter() - start > time_limit:
            capped = True
            break
        pixels = processor(images=[request["multi_modal_data"]["image"]], return_tensors="pt")
        grid = pixels["image_grid_thw"]
        ids = []
        for t in request["prompt_token_ids"]:
            ids += [t] * (int(grid.prod()) // processor.merge_size ** 2 if t == image_id else 1)
        ids = torch.tensor([ids], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), pixel_values=pixels["pixel_values"].to(device),
                             image_grid_thw=grid.to(device), mm_token_type_ids=(ids == image_id).int(),
                             do_sample=True, temperature=0.6, top_k=0, top_p=1.0, max_new_tokens=n, min_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
        tokens += out.shape[1] - ids.shape[1]
    sync(device)
    return tokens, time.perf_counter() - start, capped, "generate, one request at a time (images)"


def run_hf(args, path, prompts, max_tokens, device):
    if device == "cuda":  # (what the engine's allocator still caches would otherwise look used to HF)
        torch.cuda.empty_cache()
    model = hf_model(args, path, device)
    result = None
    if any(isinstance(p, dict) for p in prompts):  # (--images: those requests, and the text ones, one by one)
        requests = [p if isinstance(p, dict) else {"prompt_token_ids": p, "multi_modal_data": {"image": None}}
                    for p in prompts]
        with_images = [(r, n) for r, n in zip(requests, max_tokens) if r["multi_modal_data"]["image"] is not None]
        text = [(r["prompt_token_ids"], n) for r, n in zip(requests, max_tokens) if r["multi_modal_data"]["image"] is None]
        tokens, elapsed, capped, method = hf_images(model, path, *zip(*with_images), args.hf_time_limit, device)
        if text:
            more = hf_static(model, *map(list, zip(*text)), args.hf_batch_size, args.hf_time_limit, device, False)
            tokens, elapsed, capped = tokens + more[0], elapsed + more[1], capped or more[2]
            method += f", the text ones in static batches of {args.hf_batch_size}"
        result = tokens, elapsed, capped, method
    if result is None and device == "cuda" and hasattr(model, "init_continuous_batching"):
        try:
            result = hf_continuous(model, prompts, max_tokens, args.hf_time_limit)
        except Exception as e:  # noqa: BLE001 - any failure falls back to the always-available path
            print(f"HF continuous batching failed ({type(e).__name__}: {e}); using static batches", file=sys.stderr)
    if result is None:
        result = hf_static(model, prompts, max_tokens, args.hf_batch_size, args.hf_time_limit, device, not args.json)
    tokens, elapsed, capped, method = result
    return {"output_tokens": tokens, "elapsed_s": elapsed, "output_tok_per_s": tokens / elapsed,
            "ttft_s": percentiles([]), "tpot_s": percentiles([]), "capped": capped, "method": method}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Hugging Face model folder")
    p.add_argument("--dummy", choices=sorted(PRESETS), help="random weights of this preset's shape")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the engine's (float32 on CPU)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=512, help="at most --num-seqs is used")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--attention-backend", choices=["flash_attn", "triton", "torch"])
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--num-kvcache-blocks", type=int, help="fix the KV cache size (a small one shows preemption)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1, help="> 1: prints each stage's busy share of "
                   "the decode steps (and --timeline draws it step by step)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="overlap the host's work with the device's (--no-async-scheduling: the synchronous loop)")
    p.add_argument("--speculative-config", metavar="JSON", help='speculative decoding, e.g. '
                   '\'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--quantization", choices=["fp8", "awq"], help="fp8: quantize the weights at load; a quantized "
                   "checkpoint (or preset: qwen3-0.6b-fp8, -awq) needs none")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="fp8: an e4m3 KV cache")
    p.add_argument("--batch-invariant", action="store_true", help="LLM(batch_invariant=True): each sequence's "
                   "output bitwise the same whatever the batch (features/batch_invariant.py); compare tok/s with "
                   "a run without it")
    p.add_argument("--temperature", type=float, default=0.6, help="0: greedy")
    p.add_argument("--repetitive", action="store_true",
                   help="prompts that repeat a phrase of 8 tokens (text that quotes itself: n-gram drafts can hit)")
    p.add_argument("--images", type=int, default=0, metavar="N", help="the first N requests have one random "
                   "image each (a vision-language model: --dummy qwen2.5-vl-3b)")
    p.add_argument("--image-size", type=int, default=448, metavar="PIXELS", help="the images' width and height")
    p.add_argument("--compare", choices=["hf"], help="also run Hugging Face transformers and print the ratio")
    p.add_argument("--hf-batch-size", type=int, default=16, help="batch size of the static-batch baseline")
    p.add_argument("--hf-time-limit", type=float, default=float("inf"), help="seconds; caps the baseline")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--timeline", metavar="FILE.png", help="draw the run step by step (needs matplotlib)")
    p.add_argument("--probe-save", metavar="FILE.json", help="after the run, write the probe's logprobs (the "
                   "reference of a --probe-check: the unquantized model)")
    p.add_argument("--probe-check", metavar="FILE.json", help="after the run, compare the probe's logprobs with "
                   "FILE's (a quantized model against the unquantized one, same --dummy weights); exit 1 past "
                   "--probe-max-error")
    p.add_argument("--probe-max-error", type=float, default=0.1, help="the bound of --probe-check: relative L2 error")
    p.add_argument("--min-acceptance-rate", type=float, help="with --speculative-config: exit 1 below it (a draft "
                   "model equal to the target, greedy, has every draft accepted)")
    args = p.parse_args(argv)
    if args.model and args.dummy:
        p.error("--model and --dummy are exclusive")
    if not args.model and not args.dummy:
        if os.path.isdir(DEFAULT_MODEL):
            args.model = DEFAULT_MODEL
        else:
            args.dummy = "qwen3-0.6b"
    if not 1 <= args.min_input_len <= args.max_input_len or not 1 <= args.min_output_len <= args.max_output_len:
        p.error("need 1 <= min length <= max length for inputs and outputs")
    return args


def main(argv=None):
    args = parse_args(argv)
    path = args.model or write_dummy_config(args.dummy)
    args.speculative_config = dummy_draft(args.speculative_config)
    from transformers import AutoConfig
    vocab_size = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    prompts, max_tokens = make_workload(args.num_seqs, args.min_input_len, args.max_input_len, args.min_output_len,
                                        args.max_output_len, args.seed, vocab_size)
    if args.repetitive:
        prompts = [(p[:8] * (len(p) // 8 + 1))[:len(p)] for p in prompts]
    lengths = None
    if args.images:
        prompts, lengths = image_requests(path, prompts, args.images, args.image_size, args.seed)
    result = run_nanovllm(args, path, prompts, max_tokens, lengths)
    result["model"] = args.model or f"dummy:{args.dummy}"
    result["images"] = min(args.images, len(prompts))
    result["requested_output_tokens"] = sum(max_tokens)
    print(f"nanovllm  [{result['model']}, {result['device']}, {result['attention_backend']}"
          f"{', batch-invariant' if result['batch_invariant'] else ''}]: "
          f"{result['output_tokens']} output tokens in {result['elapsed_s']:.2f}s = "
          f"{result['output_tok_per_s']:.1f} tok/s (total {result['total_tok_per_s']:.1f} tok/s; "
          f"prefill {result['prefill_tok_per_s']:.1f}, decode {result['decode_tok_per_s']:.1f} tok/s)")
    for key in ("ttft_s", "tpot_s"):
        q = result[key]  # (no TPOT when every request asked for one token)
        print(f"  {key[:-2].upper()}: " + ", ".join(f"{p} {'-' if q[p] is None else f'{q[p] * 1e3:.1f} ms'}" for p in q))
    print(f"  target forwards per output token: {result['target_forwards_per_output_token']:.3f}")
    print(f"  weights: {result['weight_bytes'] / 2**20:.1f} MiB, of which linear layers and experts "
          f"{result['linear_weight_bytes'] / 2**20:.1f} MiB; KV cache: {result['num_kv_blocks']} blocks")
    if "spec_acceptance_rate" in result:
        print(f"  speculation: acceptance rate {result['spec_acceptance_rate']:.1%}, mean acceptance length "
              f"{result['spec_mean_acceptance_length']:.2f}")
    if result["gpu_idle_between_decode_steps"] is not None:
        print(f"  GPU idle between decode steps: {result['gpu_idle_between_decode_steps']:.1%} of their wall time")
    if "pipeline_stage_busy" in result:
        print("  pipeline stages busy in decode steps: " + ", ".join(
            f"stage {i} {share:.1%}" for i, share in enumerate(result["pipeline_stage_busy"])))
    if args.compare == "hf":
        baseline = run_hf(args, path, prompts, max_tokens, result["device"])
        result["baseline"] = baseline
        result["ratio"] = result["output_tok_per_s"] / baseline["output_tok_per_s"]
        print(f"HF transformers [{baseline['method']}]: {baseline['output_tokens']} output tokens in "
              f"{baseline['elapsed_s']:.2f}s = {baseline['output_tok_per_s']:.1f} tok/s"
              f"{' (capped by --hf-time-limit)' if baseline['capped'] else ''}")
        print(f"ratio nanovllm / HF (output tok/s): {result['ratio']:.2f}x")
    if args.probe_save:
        with open(args.probe_save, "w") as f:
            json.dump({"model": result["model"], "probe": result["probe"]}, f)
        print(f"probe: {sum(map(len, result['probe'].values()))} logprobs written to {args.probe_save}")
    if args.probe_check:
        with open(args.probe_check) as f:
            reference = json.load(f)
        errors = result["probe_error"] = probe_error(result["probe"], reference["probe"])
        result["probe_ok"] = all(e <= args.probe_max_error for e in errors.values())  # (False for a NaN)
        print(f"probe: relative error against {reference['model']} ({args.probe_check}): "
              f"{', '.join(f'{e:.4f} at {name}' for name, e in errors.items())}; bound {args.probe_max_error}: "
              f"{'PASS' if result['probe_ok'] else 'FAIL'}")
    result.pop("probe", None)
    result["failed_checks"] = failed_checks(args, result)
    for failure in result["failed_checks"]:
        print(f"check failed: {failure}")
    if args.json:
        print(json.dumps(result))
    return result


def failed_checks(args, result) -> list[str]:
    """What the run's output contradicts (bench.py's exit status is 1 if anything)."""
    failures = []
    if result["output_tokens"] != result["requested_output_tokens"]:  # (ignore_eos: every request runs to max_tokens)
        failures.append(f"{result['output_tokens']} output tokens, {result['requested_output_tokens']} asked for")
    if not result.get("probe_ok", True):
        failures.append(f"probe error {result['probe_error']} past {args.probe_max_error}")
    if args.min_acceptance_rate is not None and result.get("spec_acceptance_rate", 0.0) < args.min_acceptance_rate:
        failures.append(f"acceptance rate {result.get('spec_acceptance_rate')} below {args.min_acceptance_rate}")
    return failures


if __name__ == "__main__":
    sys.exit(1 if main()["failed_checks"] else 0)
