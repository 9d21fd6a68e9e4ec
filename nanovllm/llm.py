import torch

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """The public entry point: `LLM(path).generate(prompts, SamplingParams(...))`.

    model: a Hugging Face folder (config.json, *.safetensors, optional tokenizer files), or a Hub
        repository id such as "Qwen/Qwen3-0.6B" (downloaded into the Hub cache, or read from it
        offline).
    device: "cuda" when available, else "cpu".  dtype: the config's dtype on CUDA (bf16 if it
        says float32), float32 on CPU; or "float32" / "bfloat16" / "float16" / a torch dtype.
    tensor_parallel_size: ranks to shard the model over.  enforce_eager: no CUDA graphs.
    max_num_seqs: sequences per step.  max_num_batched_tokens: tokens per step (longer prompts
        are prefilled in chunks).  max_model_len: prompt + completion cap (at most the model's
        max_position_embeddings).  gpu_memory_utilization: share of GPU memory the engine may use.
    kvcache_block_size: tokens per KV block (None: 256 for flash_attn, else 16).
    num_kvcache_blocks: KV blocks (None: sized from free GPU memory, or a fixed budget on CPU).
    enable_prefix_caching: share KV blocks between requests with a common prefix.
    async_scheduling: overlap the host's work for the next step with the device's work on this
        one (False: the plain synchronous loop; the outputs are the same).
    attention_backend: "flash_attn", "triton", "torch" or None (the best available).
    load_format: "auto" (safetensors) or "dummy" (random weights, for benchmarks).
    kv_cache_dtype: "auto" (the model's dtype) or "fp8" (= "fp8_e4m3"): the paged KV cache holds
        float8_e4m3fn, twice the tokens of bf16 in the same memory; each layer's K and V are
        divided by its k_scale / v_scale on store (1.0, or the checkpoint's
        model.layers.N.self_attn.k_scale / .v_scale) and dequantized inside the attention
        kernels. Backends "triton" and "torch" (not "flash_attn").
    speculative_config: speculative decoding, with vLLM's names: {"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4} (prompt
        lookup), or {"method": "draft_model", "model": DRAFT_PATH, "num_speculative_tokens": k}
        (a smaller model with the target's tokenizer; on rank 0 only), None: off. Each decoding
        sequence proposes up to k draft tokens, and one forward of the target checks them all
        (layers/rejection_sampler.py): greedy output is unchanged, sampled output keeps the
        target's distribution. Speculative steps run synchronously.
    quantization: "fp8" quantizes the linear layers' weights at load (per output channel; a
        bf16/fp32 checkpoint); None reads the checkpoint's config.json (block-quantized FP8 and
        AWQ int4 checkpoints load as they are; "fp8" or "awq" may then name the same method).
        Embeddings, norms, MoE routers and the LM head stay unquantized (layers/quantization).
    kv_offloading_size: GiB of host memory for a second tier of the prefix cache (vLLM's name),
        over all tensor-parallel ranks together (each holds size / tensor_parallel_size: its shard
        of the same blocks); cached blocks evicted from the device are kept there and reloaded on
        a later prefix hit. 0: off. Not with a draft model (speculative_config "draft_model").
    preemption_mode: "recompute" (a preempted sequence's blocks are freed and its tokens computed
        again) or "swap" (they are kept in the host tier: needs kv_offloading_size > 0 and
        enable_prefix_caching).
    """

    def __init__(self, model: str, *, device: str | None = None, dtype: str | torch.dtype | None = None,
                 tensor_parallel_size: int = 1, enforce_eager: bool = False, max_num_seqs: int = 512,
                 max_num_batched_tokens: int = 16384, max_model_len: int = 4096,
                 gpu_memory_utilization: float = 0.9, kvcache_block_size: int | None = None,
                 num_kvcache_blocks: int | None = None, enable_prefix_caching: bool = True,
                 async_scheduling: bool = True, attention_backend: str | None = None, load_format: str = "auto",
                 kv_cache_dtype: str = "auto", speculative_config: dict | str | None = None,
                 quantization: str | None = None, kv_offloading_size: float = 0,
                 preemption_mode: str = "recompute"):
        super().__init__(Config(
            model, device=device, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            kvcache_block_size=kvcache_block_size, num_kvcache_blocks=num_kvcache_blocks,
            enable_prefix_caching=enable_prefix_caching, async_scheduling=async_scheduling,
            attention_backend=attention_backend, load_format=load_format,
            kv_cache_dtype=kv_cache_dtype, speculative_config=speculative_config, quantization=quantization,
            kv_offloading_size=kv_offloading_size, preemption_mode=preemption_mode))
