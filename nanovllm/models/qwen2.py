"""Qwen2 and Qwen2.5: the shared decoder with biases on q/k/v (not on o_proj) and no QK-norm."""
from transformers import PretrainedConfig

from nanovllm.layers.transformer import DecoderFlags, DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def flags(config: PretrainedConfig) -> DecoderFlags:
        return DecoderFlags(qkv_bias=True)
