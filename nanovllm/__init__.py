"""nanovllm's public names, loaded at first use (PEP 562): `import nanovllm.layers...` loads no engine."""
import importlib

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    if name == "LLM":
        return importlib.import_module("nanovllm.llm").LLM
    sampling_params = importlib.import_module("nanovllm.sampling_params")  # (and its own __getattr__)
    return getattr(sampling_params, name) if name in __all__ else sampling_params.__getattr__(name)
