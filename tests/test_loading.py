"""Loading a model folder: weights that do not fit config.json, unreadable files, and the model's
memory being freed as soon as the engine is dropped."""
import gc
import json
import re
import shutil
import weakref

import pytest

from nanovllm import LLM

# Small enough for CPU tests; a checkpoint needs nothing else to load.
MAX_MODEL_LEN = 64


def copy_with_config(model_dir, folder, **changes):
    """A copy of the model folder whose config.json has `changes` applied."""
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


# The tiny model: vocab 512, hidden 64, intermediate 128, 4 heads, 2 KV heads, head_dim 16. Each case
# names the first tensor (in the file's sorted order) that config.json gets wrong, and the shapes
# the config implies and the file holds.
@pytest.mark.parametrize("changes, tensor, expected, found", [
    (dict(num_key_value_heads=1), "model.layers.0.self_attn.k_proj.weight", (16, 64), (32, 64)),
    (dict(vocab_size=400), "lm_head.weight", (400, 64), (512, 64)),
    (dict(hidden_size=32, head_dim=16), "lm_head.weight", (512, 32), (512, 64)),
    (dict(intermediate_size=64), "model.layers.0.mlp.down_proj.weight", (64, 64), (64, 128)),
    (dict(head_dim=8), "model.layers.0.self_attn.k_norm.weight", (8,), (16,)),
])
def test_config_that_does_not_match_the_weights(model_dir, tmp_path, changes, tensor, expected, found):
    path = copy_with_config(model_dir, tmp_path / "m", **changes)
    with pytest.raises(ValueError) as error:
        LLM(path, max_model_len=MAX_MODEL_LEN)
    message = str(error.value)
    for part in (tensor, "model.safetensors", str(expected), str(found)):
        assert part in message, f"{part!r} missing from: {message}"


# Same element count, other shape: a size check alone would load these, scrambled. One tensor per
# kind of weight loader: packed q/k/v, packed gate/up, row-parallel, vocabulary-parallel.
@pytest.mark.parametrize("tensor, expected", [
    ("model.layers.0.self_attn.k_proj.weight", (32, 64)),
    ("model.layers.1.mlp.gate_proj.weight", (128, 64)),
    ("model.layers.0.mlp.down_proj.weight", (64, 128)),
    ("model.embed_tokens.weight", (512, 64)),
])
def test_transposed_tensor_is_refused(model_dir, tmp_path, tensor, expected):
    from safetensors.torch import load_file, save_file
    shutil.copytree(model_dir, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    tensors = load_file(weights)
    assert tuple(tensors[tensor].shape) == expected
    tensors[tensor] = tensors[tensor].t().contiguous()
    save_file(tensors, weights)
    with pytest.raises(ValueError) as error:
        LLM(str(tmp_path / "m"), max_model_len=MAX_MODEL_LEN)
    message = str(error.value)
    for part in (tensor, "model.safetensors", str(expected), str(expected[::-1])):
        assert part in message, f"{part!r} missing from: {message}"


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_unreadable_weights_file(model_dir, tmp_path, damage):
    shutil.copytree(model_dir, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[:len(data) // 2], "empty": b"",
                         "garbage": bytes(range(256)) * 64}[damage])
    with pytest.raises(ValueError, match=re.escape(str(weights))):
        LLM(str(tmp_path / "m"), max_model_len=MAX_MODEL_LEN)


@pytest.mark.parametrize("file", ["tokenizer.json", "tokenizer_config.json"])
def test_corrupt_tokenizer_file(model_dir, tmp_path, file):
    shutil.copytree(model_dir, tmp_path / "m")
    (tmp_path / "m" / file).write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(file)):
        LLM(str(tmp_path / "m"), max_model_len=MAX_MODEL_LEN)


def test_model_is_freed_without_the_garbage_collector(model_dir):
    """Reference counting alone must free the weights when the engine goes: a reference cycle
    through the model would keep its memory (GBs for real models) until the next gc pass."""
    gc.collect()
    gc.disable()
    try:
        llm = LLM(model_dir, max_model_len=MAX_MODEL_LEN)
        model = weakref.ref(llm.model_runner.model)
        weight = weakref.ref(llm.model_runner.model.model.layers[0].self_attn.qkv_proj.weight)
        del llm
        assert model() is None and weight() is None
    finally:
        gc.enable()
