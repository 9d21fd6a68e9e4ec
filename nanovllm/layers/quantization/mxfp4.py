"""MXFP4 (OCP Microscaling, FP4 E2M1 elements): gpt-oss's checkpoints store their experts so, and
nothing else. A weight [.., N, K] is held as groups of 32 values along K:

  {name}_blocks  uint8 [.., N, K / 32, 16]   two 4-bit elements a byte, the even one in the low nibble
  {name}_scales  uint8 [.., N, K / 32]       the group's power of two, biased by 127

An element's 4 bits are sign, 2 exponent bits and 1 mantissa bit: the values +-{0, 0.5, 1, 1.5, 2,
3, 4, 6} (FP4_VALUES, by code); a weight is FP4_VALUES[code] * 2 ** (scale - 127), as transformers'
integrations/mxfp4.py dequantizes it. The engine dequantizes the experts to the model's dtype as
they load (models/gpt_oss.py): exact, since every such product is a bf16 (and fp32) value. The
packed form is kept in the checkpoint for a GPU kernel later.

`quantize` is the inverse, for tests and tools: the group's scale 2 ** (floor(log2(max |w|)) - 2)
(E2M1's largest exponent is 2), each value rounded to the nearest element, clamped at +-6.
"""
import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32           # values per scale
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [.., N, G, 16], scales uint8 [.., N, G] -> [.., N, G * 32] in dtype."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
                         f"(blocks [.., N, G, {GROUP // 2}], scales [.., N, G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).int()], lut[(blocks >> 4).int()]], -1)   # [.., N, G, 16, 2]
    exponents = scales.int() - SCALE_BIAS
    weights = torch.ldexp(values.flatten(-2), exponents[..., None])                     # [.., N, G, 32]
    return weights.flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [.., N, K] (K a multiple of 32) -> (blocks, scales) as a checkpoint holds them."""
    if weight.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of {GROUP}, got {tuple(weight.shape)}")
    groups = weight.float().unflatten(-1, (-1, GROUP))                                   # [.., N, G, 32]
    amax = groups.abs().amax(-1)
    exponents = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2,
                            torch.full_like(amax, -SCALE_BIAS)).clamp(-SCALE_BIAS, 127)
    scaled = groups / torch.ldexp(torch.ones_like(amax), exponents.int())[..., None]
    lut = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs().clamp(max=6.0)[..., None] - lut).abs().argmin(-1)            # nearest magnitude
    codes = (codes + 8 * (scaled < 0)).to(torch.uint8)
    pairs = codes.unflatten(-1, (GROUP // 2, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponents.int() + SCALE_BIAS).to(torch.uint8)
