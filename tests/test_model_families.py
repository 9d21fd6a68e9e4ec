"""Qwen2, Llama and Mistral beside Qwen3: greedy output equal to Hugging Face token for token (float32,
CPU, alone and at TP=2), and a clear ValueError for every architecture or option not implemented."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_reference import assert_greedy_matches_hf
from nanovllm import LLM, SamplingParams
from nanovllm.config import Config
from nanovllm.layers.rotary_embedding import rope_inv_freq, rope_parameters

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MAX_MODEL_LEN = 400
# Llama 3.1's rope scaling, with a pretraining context (64) far below the prompts' lengths (up to
# 300), so positions beyond it are exercised. At head_dim 16 and theta 10000 the wavelengths
# (6.3 ... 19869) fall in all three bands: kept (< 64/4), interpolated, and divided by the factor (> 64/1).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# name -> (arch, seed, overrides of tiny_model's defaults: 4 query heads over 2 KV heads, untied)
MODELS = {
    "qwen2": ("qwen2", 0, {}),  # q/k/v biases
    "qwen2_tied_mha": ("qwen2", 1, dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama_biases": ("llama", 2, dict(attention_bias=True, mlp_bias=True)),
    "llama3_rope_tied": ("llama", 3, dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "mistral": ("mistral", 4, {}),  # its default sliding_window (4096) >= max_model_len: harmless
    "mistral_tied_mqa": ("mistral", 5, dict(tie_word_embeddings=True, num_key_value_heads=1)),
}


@pytest.fixture
def family_dir(tiny_models):
    """family_dir(name): the folder of MODELS[name], built on first use."""
    return lambda name: tiny_models(MODELS, name)


def check(llm, path, prompts, reference):
    assert_greedy_matches_hf(llm, path, prompts, reference, GREEDY)


@pytest.mark.parametrize("name", MODELS)
def test_family_matches_hf(name, family_dir, prompts, reference):
    path = family_dir(name)
    if name == "llama3_rope_tied":
        assert max(map(len, prompts)) > LLAMA3_ROPE["original_max_position_embeddings"]
    check(LLM(path, max_model_len=MAX_MODEL_LEN), path, prompts, reference)


# one model per new family; between them: q/k/v biases, row-parallel (o/down) and merged gate/up
# biases, and fewer KV heads (1) than ranks
@pytest.mark.parametrize("name", ["qwen2", "llama_biases", "mistral_tied_mqa"])
def test_family_tp2_matches_hf(name, family_dir, prompts, reference):
    path = family_dir(name)
    with LLM(path, tensor_parallel_size=2, max_model_len=MAX_MODEL_LEN) as llm:
        check(llm, path, prompts, reference)


# ---- RoPE: transformers' numbers, from both generations of config ----------------------------------

def test_llama3_inv_freq_is_bitwise_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # Llama 3.1 8B
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=dict(params))
    expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_factor == 1.0
    ours = rope_inv_freq(128, rope_parameters(config))
    assert ours.dtype == torch.float32 and torch.equal(ours, expected)
    assert not torch.equal(ours, rope_inv_freq(128, dict(params, rope_type="default")))


def test_rope_parameters_from_older_transformers_configs():
    """transformers < 5: rope_theta and rope_scaling attributes, the type maybe under "type"."""
    llama31 = SimpleNamespace(rope_theta=500000.0, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    params = rope_parameters(llama31)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0 and params["factor"] == 8.0
    plain = rope_parameters(SimpleNamespace(rope_theta=1e6, rope_scaling=None))
    assert plain == {"rope_type": "default", "rope_theta": 1e6}
    inv_freq = rope_inv_freq(64, plain)
    assert math.isclose(inv_freq[1].item(), 1e6 ** (-2 / 64), rel_tol=1e-6)


# ---- refusals ------------------------------------------------------------------------------------

def edited_copy(src, dst, **changes):
    """A copy of model folder `src` whose config.json has `changes` (None deletes a key)."""
    src = Path(src)
    dst.mkdir()
    for file in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if (src / file).exists():
            (dst / file).write_bytes((src / file).read_bytes())
    config = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_unsupported_architecture(family_dir, tmp_path):
    folder = edited_copy(family_dir("mistral"), tmp_path / "fancy", architectures=["FancyNewForCausalLM"])
    with pytest.raises(ValueError, match=r"unsupported model architecture 'FancyNewForCausalLM'; supported: "
                                         r"\['Gemma3ForCausalLM', 'Gemma3ForConditionalGeneration', 'GptOssForCausalLM', "
                                         r"'LlamaForCausalLM', 'MistralForCausalLM', 'MixtralForCausalLM', 'Qwen2ForCausalLM', "
                                         r"'Qwen2_5_VLForConditionalGeneration', 'Qwen3ForCausalLM', "
                                         r"'Qwen3MoeForCausalLM', 'Qwen3VLForConditionalGeneration', 'Qwen3_5ForCausalLM', "
                                         r"'Qwen3_5ForConditionalGeneration', 'Qwen3_5MoeForCausalLM', "
                                         r"'Qwen3_5MoeForConditionalGeneration'\]"):
        LLM(folder)


@pytest.mark.parametrize("model, changes, match", [
    ("mistral", dict(sliding_window=64), r"sliding_window=64 is shorter than max_model_len=400"),
    # Qwen2 turns its window on with use_sliding_window
    ("qwen2", dict(use_sliding_window=True, sliding_window=128, max_window_layers=0),
     r"sliding_window=128 is shorter than max_model_len=400"),
    ("llama_biases", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 64}), r"rope_type 'yarn'"),
    ("llama_biases", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
     r"rope_type 'linear'"),
    # the transformers 4 spelling of the same thing
    ("qwen2", dict(rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0}),
     r"rope_type 'dynamic'"),
    ("mistral", dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    ("llama_biases", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.5}), r"partial_rotary_factor=0.5"),
])
def test_unsupported_options_are_refused(family_dir, tmp_path, model, changes, match):
    folder = edited_copy(family_dir(model), tmp_path / "edited", **changes)
    with pytest.raises(ValueError, match=match):
        LLM(folder, max_model_len=MAX_MODEL_LEN)


def test_sliding_window_at_least_max_model_len_is_accepted(family_dir, tmp_path, reference):
    src = family_dir("mistral")
    folder = edited_copy(src, tmp_path / "window", sliding_window=64)
    with pytest.raises(ValueError, match="sliding_window=64"):
        LLM(folder)  # max_model_len: 4096, clamped to max_position_embeddings (1024)
    prompt = list(range(1, 41))
    check(LLM(folder, max_model_len=64), folder, [prompt], reference)  # a window of 64 drops no key here
    # the window is compared with max_model_len after the clamp to max_position_embeddings
    exact = edited_copy(src, tmp_path / "exact", sliding_window=1024, max_position_embeddings=1024)
    assert Config(exact).max_model_len == 1024


def test_odd_head_dim_is_refused(family_dir):
    """transformers 5 refuses it when reading config.json already; older releases did not."""
    from transformers import AutoConfig

    from nanovllm.models import resolve_model_class
    config = AutoConfig.from_pretrained(family_dir("llama_biases"))
    config.head_dim = 15
    with pytest.raises(ValueError, match="head_dim=15"):
        resolve_model_class(config, MAX_MODEL_LEN)
