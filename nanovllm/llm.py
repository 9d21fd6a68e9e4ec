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

    def update_weights_from_disk(self, model_path: str) -> int:
        """Every tensor of a checkpoint folder's *.safetensors into the model, as update_weights."""
        from nanovllm.features.weight_updates import update_weights_from_disk
        return update_weights_from_disk(self, model_path)

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 backend: str | None = None, timeout_s: float = 60.0):
        """Join a trainer's torch.distributed group (its rank 0; this engine's ranks from rank_offset)."""
        from nanovllm.features.weight_sync import init_weight_update_group  # (RL rollouts': loaded when used)
        init_weight_update_group(self, master_address, master_port, rank_offset, world_size, backend, timeout_s)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list) -> int:
        """Receive the trainer's broadcast of these tensors, in order, into the model, as update_weights."""
        from nanovllm.features.weight_sync import update_weights_from_distributed
        return update_weights_from_distributed(self, names, dtypes, shapes)

    def reset_prefix_cache(self):
        """Forget every cached prefix (the engine idle), as after new weights."""
        from nanovllm.features.idle_engine import reset_prefix_cache
        reset_prefix_cache(self)

    def sleep(self, level: int = 1):
        """Free the KV cache (level 1: weights to host memory; 2: weights dropped) until wake_up()."""
        from nanovllm.features.sleep_mode import sleep  # (RL rollouts': loaded when used)
        sleep(self, level)

    def wake_up(self, tags: list[str] | None = None):
        """Back from sleep(): tags "weights", "kv_cache" (None: both), as vLLM's."""
        from nanovllm.features.sleep_mode import wake_up
        wake_up(self, tags)
