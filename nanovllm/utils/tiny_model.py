"""Tiny random-weight Hugging Face model folders, built locally (no downloads), for tests and demos:
config.json, model.safetensors and a byte-level BPE tokenizer trained here on a few sentences (with an
EOS token), as `from_pretrained` expects them.
"""
import glob
import json
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nanovllm.layers.quantization import awq, fp8

EOS_TOKEN = "<|endoftext|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching lets sequences join and leave at every step.",
    "Prefix caching shares the blocks of a common prompt prefix between requests.",
    "日本語のテキストと絵文字 🚀 も扱えます。 Ünïcödé façade naïve café.",
    "def forward(self, x):\n    return self.linear(x) + 1\n",
] * 4


# A ChatML template (Qwen's turn markers), for models built with chat_template=True; with tools,
# a system turn lists them and calls and results render as Qwen2.5's and Qwen3's templates do.
CHATML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nCall one with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}<|im_start|>assistant\n"
    "{% for call in message['tool_calls'] %}<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer(path: str, vocab_size: int = 400, chat_template: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN)
    if chat_template:
        fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(path)
    return fast


# arch -> (Hugging Face config class, model class), all of the same tiny sizes; what distinguishes a
# family (biases, rope scaling, sliding window, ...) comes from its config class's defaults or **overrides.
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    # mixtures of experts: 4 experts, 2 per token (Qwen3-MoE's experts moe_intermediate_size wide)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    # local (sliding-window) and global attention layers, (1 + w) norms, tied head (Gemma3TextConfig's defaults)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    # three Gated DeltaNet layers and one gated full-attention layer (Qwen3_5TextConfig's layer_types)
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    # sliding-window (16) and full layers, both with sinks; 4 experts with biases, 2 a token
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    # Qwen3.5's layers, each MLP 4 experts (2 a token) and a gated shared expert
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
}
# Every family's tiny sizes (a multimodal checkpoint's text model too), under FAMILY_SETTINGS and overrides.
TINY_SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.2)
MOE_SETTINGS = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
                "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)}
# Qwen3.5's linear-attention sizes: 2 key heads of 16, 4 value heads of 16 (two per key head)
LINEAR_ATTENTION_SETTINGS = dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
# gpt-oss's: a clamp of 1.5 (the checkpoints' 7) so that the tiny experts' SwiGLU reaches it; YaRN over 64
# positions (the checkpoints' 4,096), so that prompts of a few hundred tokens are past it
GPT_OSS_SETTINGS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=16,
                        swiglu_limit=1.5, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0,
                                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                           "original_max_position_embeddings": 64})
FAMILY_SETTINGS = {**MOE_SETTINGS, "qwen3_5": LINEAR_ATTENTION_SETTINGS, "gpt_oss": GPT_OSS_SETTINGS,
                   "qwen3_5_moe": dict(LINEAR_ATTENTION_SETTINGS, num_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, shared_expert_intermediate_size=48)}


def build_model(path: str, arch: str = "qwen3", tokenizer: bool = True, seed: int = 0, chat_template: bool = False,
                **overrides) -> str:
    """Write a tiny random-weight model of family `arch` (a key of FAMILIES) to `path`; returns path.
    chat_template: give its tokenizer a ChatML chat template. Weights have a larger spread than real
    checkpoints' (initializer_range 0.2), so logits are far apart and greedy decoding is robust to
    float rounding differences.
    """
    import transformers

    if arch not in FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; known: {sorted(FAMILIES)}")
    os.makedirs(path, exist_ok=True)
    eos_id = None
    if tokenizer:
        eos_id = build_tokenizer(path, chat_template=chat_template).convert_tokens_to_ids(EOS_TOKEN)
    settings = dict(TINY_SIZES, tie_word_embeddings=False, eos_token_id=eos_id if eos_id is not None else 0,
                    dtype="float32")
    settings.update(FAMILY_SETTINGS.get(arch, {}))
    settings.update(overrides)
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[arch])
    config = config_class(**settings)
    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    draw_zero_initialized(model, config.initializer_range)
    model.save_pretrained(path)
    return path


@torch.no_grad()
def draw_zero_initialized(model, spread: float):
    """Draw at random (normal, std `spread`) what transformers zeroes at init: biases (gpt-oss's
    experts' `..._bias` too), and the
    (1 + w) norm weights of Gemma and Qwen3.5, whose code paths would otherwise go untested (other
    families' norm weights start at 1: kept)."""
    for name, param in model.named_parameters():
        if name.endswith((".bias", "_bias")) or (name.endswith("norm.weight") and not param.any()):
            param.normal_(0.0, spread)


# ---- quantized checkpoints, in the published formats ----------------------------------------------
# Decoder layers' linear weights (experts' included); routers, embeddings, norms and the LM head stay.
LINEAR_WEIGHT = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": [128, 128]}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}


def edit_model(src, dst, edit_tensors=None, edit_config=None) -> str:
    """Copy model folder src to dst, each weights file's tensors through edit_tensors(dict) and
    config.json's contents through edit_config(dict) (both edit in place); returns dst. Tests make
    broken or converted checkpoints with it."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    if edit_tensors is not None:
        for file in sorted(glob.glob(os.path.join(dst, "*.safetensors"))):
            tensors = load_file(file)
            edit_tensors(tensors)
            save_file(tensors, file, metadata={"format": "pt"})
    if edit_config is not None:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            config = json.load(f)
        edit_config(config)
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
    return str(dst)


def _rewrite(src: str, dst: str, convert, quantization_config: dict | None) -> str:
    """Copy model folder src to dst, each tensor through convert(name, tensor) -> {name: tensor},
    config.json's quantization_config set (None: removed)."""
    def convert_all(tensors: dict):
        converted = {new: t for name, tensor in tensors.items() for new, t in convert(name, tensor).items()}
        tensors.clear()
        tensors.update(converted)

    def set_quantization(config: dict):
        config.pop("quantization_config", None)
        if quantization_config is not None:
            config["quantization_config"] = quantization_config

    return edit_model(src, dst, convert_all, set_quantization)


def quantize_checkpoint(src: str, dst: str, method: str, modules_to_not_convert: list[str] = ()) -> str:
    """Write model folder src's linear layers to dst quantized as the published checkpoints are, by
    method "fp8" (Qwen3-*-FP8: 128 x 128 blocks) or "awq" (Qwen3-*-AWQ); layers whose name contains
    an entry of modules_to_not_convert are kept."""
    def convert(name, tensor):
        if not LINEAR_WEIGHT.search(name) or any(m in name for m in modules_to_not_convert):
            return {name: tensor}
        base = name[:-len(".weight")]
        if method == "fp8":
            q, scale_inv = fp8.quantize_block(tensor)
            return {name: q, f"{base}.weight_scale_inv": scale_inv}
        qweight, qzeros, scales = awq.quantize(tensor.T.contiguous())
        return {f"{base}.qweight": qweight, f"{base}.qzeros": qzeros, f"{base}.scales": scales}

    config = dict(FP8_BLOCK_CONFIG if method == "fp8" else AWQ_CONFIG)
    if modules_to_not_convert:
        config["modules_to_not_convert"] = list(modules_to_not_convert)
    return _rewrite(src, dst, convert, config)


def dequantize_checkpoint(src: str, dst: str) -> str:
    """The float32 checkpoint of the weights a quantized checkpoint (from quantize_checkpoint)
    stands for: what it computes, in plain weights."""
    tensors = {}
    for file in glob.glob(os.path.join(src, "*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})

    def convert(name, tensor):
        if name.endswith((".weight_scale_inv", ".qzeros", ".scales")):
            return {}
        if name.endswith(".qweight"):
            base = name[:-len(".qweight")]
            w = awq.dequantize(tensor, tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], 128, torch.float32)
            return {f"{base}.weight": w.T.contiguous()}
        if tensor.dtype == fp8.FP8:
            scale_inv = tensors[name.replace(".weight", ".weight_scale_inv")]
            return {name: fp8.dequantize_block(tensor, scale_inv, (128, 128), torch.float32)}
        return {name: tensor}

    return _rewrite(src, dst, convert, None)


def fake_quantize_per_channel(src: str, dst: str) -> str:
    """The float32 checkpoint of what quantization="fp8" makes of src's linear layers (each row
    quantized to fp8 with its own scale, and back)."""
    def convert(name, tensor):
        if not LINEAR_WEIGHT.search(name):
            return {name: tensor}
        return {name: fp8.dequantize_per_channel(*fp8.quantize_per_channel(tensor), torch.float32)}

    return _rewrite(src, dst, convert, None)
