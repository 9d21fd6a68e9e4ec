from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """The public entry point: `LLM(path, **options).generate(prompts, SamplingParams(...))`.
    Each option is a field of Config (nanovllm/config.py), which documents and validates it; an
    option it does not have is a TypeError naming the ones it has."""

    def __init__(self, model: str, **options):
        super().__init__(Config.from_options(model, options))
