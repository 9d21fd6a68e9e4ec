from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """The public entry point: `LLM(path, **options).generate(prompts, SamplingParams(...))`.
    Each option is a field of Config (nanovllm/config.py), which documents and validates it; an
    option it does not have is a TypeError naming the ones it has."""

    def __init__(self, model: str, **options):
        super().__init__(Config.from_options(model, options))

    def chat(self, messages: list[dict], sampling_params, use_tqdm: bool = True) -> dict:
        """One conversation's completion: OpenAI-style messages (images in content parts) through the chat template."""
        from nanovllm.features.chat_template import chat_prompt  # (chat's: loaded when used)
        return self.generate([chat_prompt(self, messages)], sampling_params, use_tqdm)[0]

    def update_weights(self, named_tensors) -> int:
        """(name, tensor) pairs in Hugging Face's names into the model in place; the prefix cache reset."""
        from nanovllm.features.weight_updates import update_weights  # (RL rollouts': loaded when used)
        return update_weights(self, named_tensors)

    def reset_prefix_cache(self):
        """Forget every cached prefix (the engine idle), as after new weights."""
        from nanovllm.features.weight_updates import reset_prefix_cache
        reset_prefix_cache(self)
