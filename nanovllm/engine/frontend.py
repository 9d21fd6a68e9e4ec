"""The request side of the engine, which needs no model: the tokenizer, prompts as checked token ids
(chat templates rendered), each request's checks against the configuration, and structured outputs'
grammar compiler. LLMEngine is a Frontend with a scheduler, block manager and model runner behind it;
a front with no model (of data-parallel replicas) can be one. Any thread (the server's) may call it."""
import json
import operator
import os
import threading


from nanovllm.config import Config
from nanovllm.sampling_params import SamplingParams, is_integer
from nanovllm.utils.logging import configure_logging

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The folder's tokenizer, or None when it ships none (prompts must then be token ids)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    # transformers lets a JSON error escape without saying which file it was in: check them first.
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "vocab.json"):
        file = os.path.join(path, name)
        if os.path.exists(file):
            try:
                with open(file, encoding="utf-8") as f:
                    json.load(f)
            except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                raise ValueError(f"tokenizer file {file!r} is not valid JSON: {e}") from e
    from transformers import AutoTokenizer  # (a heavy import: only for a model that ships a tokenizer)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # tokenizers raises plain Exception for a tokenizer.json it cannot parse
        raise ValueError(f"cannot load the tokenizer in {path!r}: {type(e).__name__}: {e}") from e


class PromptTooLong(ValueError):
    """A prompt that leaves no room to generate within max_model_len."""

    def __init__(self, num_tokens: int, max_model_len: int):
        super().__init__(f"the prompt has {num_tokens} tokens or more, which leaves no room to generate within "
                         f"max_model_len={max_model_len}")
        self.num_tokens = num_tokens


class Frontend:
    """The tokenizer and the checks of requests for `config`'s model (see the module's docstring)."""

    def __init__(self, config: Config):
        configure_logging()  # (here, not on import: an application configures its logging first)
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        if config.draft_hf_config is not None:  # its token ids must mean the target's text
            config.speculative.check_tokenizer(self.tokenizer, load_tokenizer(config.speculative.model),
                                               config.hf_config.vocab_size, config.draft_hf_config.vocab_size)
        eos = config.eos_token_ids
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos = {self.tokenizer.eos_token_id}
        self.eos_token_ids = eos
        self.grammars = None  # structured outputs' compiler (structured_outputs.Grammars), made at the first constraint
        self._grammars_lock = threading.Lock()

    def encode_prompt(self, prompt) -> list[int]:
        """A prompt (a str, token ids, or a dict with images) as validated token ids, else a TypeError or ValueError."""
        if isinstance(prompt, dict):  # {"prompt" or "prompt_token_ids", "multi_modal_data"}: features/multimodal.py
            from nanovllm.features.multimodal import encode_multimodal
            return encode_multimodal(self, prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model!r} has no tokenizer: pass prompts as lists of token ids")
            ids = self._encode_text(prompt, add_special_tokens=True)
        elif isinstance(prompt, (list, tuple)):
            if len(prompt) >= self.config.max_model_len:  # (refused before a million ids are checked)
                raise PromptTooLong(len(prompt), self.config.max_model_len)
            bad = next((t for t in prompt if not is_integer(t)), None)
            if bad is not None:
                raise TypeError(f"a prompt's token ids must be ints, got {bad!r} of type {type(bad).__name__}")
            ids = prompt if hasattr(prompt, "sequence_class") else [operator.index(t) for t in prompt]  # (images)
        else:
            raise TypeError(f"a prompt must be a str, a list of int token ids or a dict, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("a prompt must have at least one token, got an empty prompt")
        vocab_size = self.config.hf_config.vocab_size
        if not 0 <= min(ids) <= max(ids) < vocab_size:  # (min and max: C loops, quick on a long prompt)
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
        return ids

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        """Chat messages as prompt token ids (features/chat_template.py's render_chat)."""
        from nanovllm.features.chat_template import render_chat  # (chat's: loaded at the first chat request)
        text = render_chat(self.tokenizer, self.config.model, messages, tools, template_kwargs)
        return self._encode_text(text, add_special_tokens=False)  # (the template has any BOS already)

    def check_chat_template_kwargs(self, template_kwargs: dict):
        """A ValueError unless each key is a chat template variable a request may set (chat_template.py)."""
        from nanovllm.features.chat_template import check_template_kwargs  # (chat's: loaded when used)
        check_template_kwargs(self.tokenizer, self.config.model, template_kwargs)

    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """text's token ids. A text far longer than max_model_len is first counted by the fast
        tokenizer's backend, and refused before its ids become Python ints: the backend works
        without the GIL, but a list of 8 million ints holds it for a quarter of a second that every
        other thread (the server's event loop) waits out."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        max_model_len = self.config.max_model_len
        if backend is not None and len(text) > 4 * max_model_len:  # (real tokens hold ~4 characters)
            num_tokens = len(backend.encode_batch([text], add_special_tokens=False)[0])  # (a lower bound)
            if num_tokens >= max_model_len:
                raise PromptTooLong(num_tokens, max_model_len)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_request(self, num_prompt_tokens: int, sampling_params: SamplingParams):
        """Whether a prompt of this many (valid) tokens can run with these parameters (a TypeError
        or ValueError names what is wrong). Reads only the configuration: any thread (the server's) may call it."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if num_prompt_tokens + sampling_params.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens plus max_tokens={sampling_params.max_tokens} "
                             f"exceeds max_model_len={self.config.max_model_len}")
        vocab_size = self.config.hf_config.vocab_size
        if sampling_params.top_k > vocab_size:
            raise ValueError(f"SamplingParams.top_k={sampling_params.top_k} exceeds the model's vocabulary of "
                             f"{vocab_size} tokens")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(sampling_params, name)
            if k is not None and k > vocab_size:
                raise ValueError(f"SamplingParams.{name}={k} exceeds the model's vocabulary of {vocab_size} tokens")
        for name, ids in (("stop_token_ids", sampling_params.stop_token_ids),
                          ("logit_bias", sampling_params.logit_bias or ()),
                          ("allowed_token_ids", sampling_params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"SamplingParams.{name} has {bad[0]}, outside the vocabulary [0, {vocab_size})")
        if sampling_params.stop_strings and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop needs a tokenizer, and {self.config.model!r} has none; "
                             "use stop_token_ids")

    def grammar_compiler(self):
        """The engine's grammar compiler (structured_outputs.Grammars), made at the first constraint."""
        if self.tokenizer is None:
            raise ValueError(f"structured_outputs need a tokenizer, and {self.config.model!r} has none")
        from nanovllm.features.structured_outputs import Grammars  # (structured outputs' layer: loaded when used)
        with self._grammars_lock:
            if self.grammars is None:
                self.grammars = Grammars(self.tokenizer, self.config.hf_config.vocab_size, self.eos_token_ids)
        return self.grammars
