"""The engine's optional capabilities, each a layer of its own: imported only when a request, an
option or a checkpoint asks for it, and entered through one named hook of the core (README.md,
"The path of one request", lists each layer and its hook). Everything outside this package and
entrypoints/ is the core a plain generate loads (scripts/core_lines.py), but for the MoE and
quantized layers, which models/ and layers/quantization/ load when a checkpoint names them."""
