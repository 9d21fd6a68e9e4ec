"""Qwen3: the shared decoder with RMSNorm over each query and key head before RoPE."""
from transformers import PretrainedConfig

from nanovllm.layers.transformer import DecoderFlags, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def flags(config: PretrainedConfig) -> DecoderFlags:
        bias = getattr(config, "attention_bias", False)  # on q/k/v and o_proj alike, as in transformers
        return DecoderFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)
