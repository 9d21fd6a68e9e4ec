"""speculative_config: which drafts (prompt lookup, or a draft model), how many, and the checks a
draft model must pass against the target (Config builds it when the option is given)."""
import json
import os
from dataclasses import dataclass

from transformers import AutoConfig, PretrainedConfig

from nanovllm.models import resolve_model_class
from nanovllm.features.speculative.ngram import NgramProposer
from nanovllm.utils.hub import resolve_model

SPECULATIVE_METHODS = ("ngram", "draft_model")
# The longest draft (vLLM's EAGLE drafts 3 to 10): a draft's n-th token counts only if all before it
# are accepted, so past 32 a step would verify tokens that almost never count (and counters grow with k).
MAX_SPECULATIVE_TOKENS = 32
SPECULATIVE_KEYS = {"ngram": {"prompt_lookup_min", "prompt_lookup_max"}, "draft_model": {"model"}}


@dataclass(frozen=True)
class SpeculativeConfig:
    """speculative_config, with vLLM's names: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": 2, "prompt_lookup_max": 4} (prompt lookup), or {"method": "draft_model",
    "model": DRAFT_PATH, "num_speculative_tokens": k} (a smaller model with the target's tokenizer)."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: its folder

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """The checked config of a dict (or its JSON text, from the command line); None stays None."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config's method must be one of {list(SPECULATIVE_METHODS)}, got "
                             f"{method!r}")
        known = {"method", "num_speculative_tokens"} | SPECULATIVE_KEYS[method]
        if unknown := sorted(set(value) - known):
            raise ValueError(f"speculative_config has unknown keys {unknown}; method {method!r} takes {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens (the draft length k >= 1)")
        config = cls(**value)
        k = config.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config's num_speculative_tokens must be an int in [1, "
                             f"{MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if method == "ngram":
            NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)  # (checks)
        elif not isinstance(config.model, (str, os.PathLike)):
            raise ValueError(f"speculative_config's method 'draft_model' needs \"model\": the draft model's folder, "
                             f"got {config.model!r}")
        return config

    def draft_hf_config(self, target: PretrainedConfig, max_model_len: int) -> PretrainedConfig:
        """The draft model's config, checked against the target's: an architecture this engine
        runs, positions up to max_model_len, and logits over the target's token ids (the two
        tokenizers are compared once the engine has loaded them: check_draft_tokenizer)."""
        folder = resolve_model(self.model, "speculative_config's draft model")
        object.__setattr__(self, "model", folder)  # (a Hub id: its local snapshot)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ValueError(f"speculative_config's draft model folder {folder!r} has no config.json")
        try:
            config = AutoConfig.from_pretrained(folder)
        except Exception as e:
            raise ValueError(f"cannot read the draft model's {folder}/config.json: {e}") from e
        resolve_model_class(config, max_model_len)  # (ValueError: an architecture the engine does not run)
        positions = getattr(config, "max_position_embeddings", None)
        if positions is not None and positions < max_model_len:
            raise ValueError(f"the draft model {folder!r} takes {positions} positions (max_position_embeddings), "
                             f"fewer than max_model_len={max_model_len}: lower max_model_len")
        return config

    def check_tokenizer(self, target, draft, target_vocab_size: int, draft_vocab_size: int):
        """check_draft_tokenizer of this config's draft model."""
        check_draft_tokenizer(target, draft, target_vocab_size, draft_vocab_size, self.model)


def check_draft_tokenizer(target, draft, target_vocab_size: int, draft_vocab_size: int, folder: str):
    """A draft model must propose the target's token ids: the same tokenizer vocabulary (its
    embedding tables may be padded differently: Qwen2.5's 0.5B has 151,936 rows, its 7B 152,064),
    each model's vocab_size covering it."""
    if target is None or draft is None:
        if target is not None or draft is not None:
            raise ValueError(f"the draft model {folder!r} and the target must both have a tokenizer, or neither")
        if draft_vocab_size != target_vocab_size:
            raise ValueError(f"the draft model {folder!r} has vocab_size {draft_vocab_size}, the target "
                             f"{target_vocab_size}; without tokenizers to compare they must be equal")
        return
    vocab = target.get_vocab()
    if draft.get_vocab() != vocab:
        raise ValueError(f"the draft model {folder!r} has a different tokenizer vocabulary from the target's "
                         f"({len(draft.get_vocab())} against {len(vocab)} tokens): its token ids would mean other text")
    needed = max(vocab.values(), default=-1) + 1
    if min(draft_vocab_size, target_vocab_size) < needed:
        raise ValueError(f"the draft model {folder!r} (vocab_size {draft_vocab_size}) or the target "
                         f"({target_vocab_size}) has fewer logits than the tokenizer's {needed} ids")
