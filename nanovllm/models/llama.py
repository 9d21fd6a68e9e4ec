"""Llama 2 and 3.x: the shared decoder; attention_bias puts biases on q/k/v/o, mlp_bias on
gate/up/down. Llama 3.1's "llama3" rope scaling lives in layers/rotary_embedding.py."""
from transformers import PretrainedConfig

from nanovllm.layers.transformer import DecoderFlags, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    @staticmethod
    def flags(config: PretrainedConfig) -> DecoderFlags:
        attention_bias = getattr(config, "attention_bias", False)
        return DecoderFlags(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=getattr(config, "mlp_bias", False))
