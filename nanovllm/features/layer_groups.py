"""Which runner, scheduler and block manager run a model that needs more than the core's: one whose
class says so (`engine_layers = True`): one whose layers are of several kinds (config.layer_types),
one group of layers per kind, and then, for a model that takes images (`takes_images`), image
input's over those (features/multimodal.py):

  linear_attention    features/state_cache.py: a fixed-size state per sequence, in its row's slot
  sliding_attention   features/window_blocks.py: a pool of blocks of their own, the window's alone;
                      not with speculative decoding, pipeline stages or the host tier (nor for a
                      model of sliding layers alone), where every layer shares the full pool's
                      blocks as before
The engine's one hook (LLMEngine.__init__) hands over the classes it would use otherwise.
"""
from nanovllm.engine.block_manager import BlockManager
from nanovllm.models import resolve_model_class


def group_classes(config, runner_class: type, scheduler_class: type) -> tuple[type, type, object]:
    classes = layer_group_classes(config, runner_class, scheduler_class)
    if not getattr(resolve_model_class(config.hf_config), "takes_images", False):
        return classes
    if "linear_attention" in (getattr(config.hf_config, "layer_types", None) or ()):  # (Qwen3.5 with images)
        from nanovllm.features.multimodal_state import MultimodalStateRunner, MultimodalStateScheduler
        return MultimodalStateRunner, MultimodalStateScheduler, classes[2]
    from nanovllm.features.multimodal import multimodal_classes
    return multimodal_classes(config, *classes)


def layer_group_classes(config, runner_class: type, scheduler_class: type) -> tuple[type, type, object]:
    kinds = set(getattr(config.hf_config, "layer_types", None) or ())
    if "linear_attention" in kinds:
        from nanovllm.features.state_cache import state_cache_classes
        return state_cache_classes(config)
    if ("sliding_attention" in kinds and "full_attention" in kinds and config.speculative is None
            and config.pipeline_parallel_size == 1 and not config.kv_offloading_size
            and config.preemption_mode == "recompute"):
        from nanovllm.features.window_blocks import window_group_classes
        return window_group_classes(config)
    return runner_class, scheduler_class, BlockManager
