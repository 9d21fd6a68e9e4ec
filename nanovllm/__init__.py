from nanovllm import sampling_params
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]
__getattr__ = sampling_params.__getattr__  # StructuredOutputsParams, loaded at its first use (PEP 562)
