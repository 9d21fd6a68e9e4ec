"""Quantized weights: one module per scheme behind one interface the linear layers call.

  fp8.py   FP8 e4m3: per-output-channel scales quantized at load from a bf16/fp32 checkpoint
           (quantization="fp8"), or the 128 x 128 block-scaled checkpoints (Qwen3-*-FP8)
  awq.py   AWQ int4 checkpoints (Qwen3-*-AWQ): 4 bits, groups of 128 inputs, zero points
  mxfp4.py gpt-oss's MXFP4 experts (FP4 elements, a power-of-two scale per 32), dequantized at load;
           its other layers are unquantized in the checkpoint, and stay so

`QuantizationConfig.resolve(argument, hf_config)` checks that what the user asked for and config.json's
quantization_config agree. Models built in its `quantization_scope` (layers/linear.py) call its
`linear_method`. The package is imported only when the caller or the checkpoint asks for quantization.
"""
from dataclasses import dataclass

QUANTIZATION_METHODS = ("fp8", "awq")
MXFP4_MODEL_TYPES = ("gpt_oss",)  # checkpoints whose quant_method "mxfp4" (experts only) is read
SUPPORTED_FP8_BLOCK = (128, 128)
SUPPORTED_AWQ = {"bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


@dataclass(frozen=True)
class QuantizationConfig:
    """method: "fp8", "awq" or "mxfp4" (a checkpoint's only). weight_block_size: fp8 checkpoints'
    (bn, bk) block (None: per-channel scales, the weights quantized at load). group_size: awq's
    inputs per scale. serialized: the checkpoint holds quantized tensors (else they are quantized
    as they load).
    modules_to_not_convert: names (or name fragments) of layers the checkpoint keeps unquantized."""
    method: str
    serialized: bool
    weight_block_size: tuple[int, int] | None = None
    group_size: int = 128
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def resolve(cls, argument: str | None, hf_config) -> "QuantizationConfig | None":
        """The quantization of an engine: config.json's quantization_config if it has one (the argument,
        if given, must name the same method), else quantization="fp8" quantizes at load; or None."""
        if argument is not None and argument not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be None or one of {list(QUANTIZATION_METHODS)}, got {argument!r}")
        checkpoint = getattr(hf_config, "quantization_config", None)
        if checkpoint is None:
            if argument == "awq":
                raise ValueError("quantization='awq' needs an AWQ checkpoint (config.json's quantization_config "
                                 "with quant_method 'awq'); only 'fp8' quantizes an unquantized checkpoint at load")
            return cls("fp8", serialized=False) if argument == "fp8" else None
        if not isinstance(checkpoint, dict):
            checkpoint = checkpoint.to_dict()
        method = checkpoint.get("quant_method")
        if method == "mxfp4":
            return cls._mxfp4(argument, hf_config)
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"config.json's quantization_config has quant_method {method!r}; supported: "
                             f"{list(QUANTIZATION_METHODS)}")
        if argument is not None and argument != method:
            raise ValueError(f"quantization={argument!r} contradicts the checkpoint, whose config.json says "
                             f"quant_method {method!r}; pass quantization=None or {method!r}")
        skip = tuple(checkpoint.get("modules_to_not_convert") or ())
        if method == "fp8":
            return cls._fp8(checkpoint, skip)
        return cls._awq(checkpoint, skip)

    @classmethod
    def _mxfp4(cls, argument: str | None, hf_config) -> "QuantizationConfig":
        """gpt-oss's checkpoints: MXFP4 experts (its experts module reads them), the rest unquantized."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in MXFP4_MODEL_TYPES:
            raise ValueError(f"quant_method 'mxfp4' is supported for {list(MXFP4_MODEL_TYPES)} checkpoints (their "
                             f"experts), not model_type {model_type!r}")
        if argument is not None:
            raise ValueError(f"quantization={argument!r} contradicts the checkpoint, whose config.json says "
                             f"quant_method 'mxfp4'; pass quantization=None")
        return cls("mxfp4", serialized=True)

    @classmethod
    def _fp8(cls, checkpoint: dict, skip: tuple[str, ...]) -> "QuantizationConfig":
        if checkpoint.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"fp8 checkpoints with activation_scheme {checkpoint['activation_scheme']!r} are not "
                             f"supported; supported: 'dynamic'")
        if checkpoint.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 checkpoints in fmt {checkpoint['fmt']!r} are not supported; supported: 'e4m3'")
        block = checkpoint.get("weight_block_size")
        if block is None or tuple(block) != SUPPORTED_FP8_BLOCK:
            raise ValueError(f"fp8 checkpoints need weight_block_size {list(SUPPORTED_FP8_BLOCK)} (block-quantized, "
                             f"as Qwen3's FP8 checkpoints), got {block!r}")
        return cls("fp8", serialized=True, weight_block_size=tuple(block), modules_to_not_convert=skip)

    @classmethod
    def _awq(cls, checkpoint: dict, skip: tuple[str, ...]) -> "QuantizationConfig":
        found = {"bits": checkpoint.get("bits", checkpoint.get("w_bit")),
                 "group_size": checkpoint.get("group_size", checkpoint.get("q_group_size")),
                 "zero_point": checkpoint.get("zero_point", True),
                 "version": str(checkpoint.get("version", "gemm")).lower()}
        for name, value in found.items():
            if value != SUPPORTED_AWQ[name]:
                raise ValueError(f"AWQ checkpoints with {name}={value!r} are not supported; supported: "
                                 f"{SUPPORTED_AWQ}")
        return cls("awq", serialized=True, group_size=found["group_size"], modules_to_not_convert=skip)

    def skips(self, prefix: str) -> bool:
        """Whether the layer named `prefix` (model.layers.0.mlp.down_proj) stays unquantized: a
        modules_to_not_convert entry names a run of its dotted parts ("lm_head", "mlp.down_proj",
        "layers.0"). A packed layer goes by its checkpoint parts (qkv_proj by q_proj, k_proj and v_proj),
        which must then all be listed or none."""
        parent, _, leaf = prefix.rpartition(".")
        parts = [f"{parent}.{part}" for part in PACKED_PARTS.get(leaf, (leaf,))]
        skipped = [any(names_module(entry, part) for entry in self.modules_to_not_convert) for part in parts]
        if any(skipped) and not all(skipped):
            raise ValueError(f"modules_to_not_convert lists some of {parts} but not all; they are one packed layer "
                             f"here, quantized or not as a whole")
        return all(skipped)

    def linear_method(self, prefix: str):
        """The method of the linear layer named `prefix` (None: unquantized), for layers/linear.py; a
        scheme's module is imported when a model is built with it."""
        if self.method == "mxfp4" or self.skips(prefix):  # (MXFP4: the experts alone, not linear layers)
            return None
        if self.method == "awq":
            from nanovllm.layers.quantization.awq import AwqLinearMethod
            return AwqLinearMethod(self.group_size)
        from nanovllm.layers.quantization.fp8 import Fp8BlockLinearMethod, Fp8LinearMethod
        return Fp8BlockLinearMethod(self.weight_block_size) if self.serialized else Fp8LinearMethod()


# our packed layers -> the checkpoint layers they hold
PACKED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def names_module(entry: str, name: str) -> bool:
    """Whether dotted name `entry` is a contiguous run of `name`'s dotted parts."""
    want, have = entry.split("."), name.split(".")
    return any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))
