from nanovllm.layers.transformer import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral: the shared decoder, no biases. Its sliding window is accepted only when it is at
    least max_model_len long (then it never drops a key); check_config refuses a shorter one."""
