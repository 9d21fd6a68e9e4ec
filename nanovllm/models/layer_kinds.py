"""What the families with layers of several kinds share (Gemma 3, Qwen3.5): their config.layer_types checked."""
from transformers import PretrainedConfig


def check_layer_types(config: PretrainedConfig, supported: tuple[str, ...], family: str):
    """ValueError naming the kinds in config.layer_types that `family`'s module does not build, or
    a list whose length is not num_hidden_layers."""
    unknown = sorted(set(config.layer_types) - set(supported))
    if unknown:
        raise ValueError(f"layer type(s) {unknown} in config.layer_types are not supported for {family}; supported: "
                         f"{list(supported)}")
    if len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types has {len(config.layer_types)} entries for "
                         f"num_hidden_layers={config.num_hidden_layers}")
