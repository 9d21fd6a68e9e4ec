import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanovllm.features.structured_params import StructuredOutputsParams

@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completion, as in vLLM; validated at construction, then frozen
    (a field changed later would skip the checks: `dataclasses.replace` makes a validated copy).

    temperature: 0 is greedy (argmax); otherwise logits are divided by it before softmax.
    top_k: keep the k most likely tokens (-1: all).  top_p: keep the smallest set of tokens whose
        probability reaches p (1.0: all).  min_p: drop tokens less likely than min_p times the
        most likely one (0: off).
    presence_penalty, frequency_penalty: subtracted from a token's logit once if it occurs in the
        completion, and once per occurrence ([-2, 2]; 0: off).  repetition_penalty: logits of tokens
        seen in the prompt or completion are divided by it when positive, multiplied when negative (> 0; 1: off).
    max_tokens: completion length cap (>= 1).  min_tokens: EOS, stop tokens and stop strings are
        ignored before this many tokens.  ignore_eos: generate past EOS (benchmarks).
    stop: strings that end the completion (stored as a tuple); the text ends before the stop
        string unless include_stop_str_in_output.  stop_token_ids: token ids that end it (a tuple).
    skip_special_tokens: leave special tokens out of the text (as vLLM's; gpt-oss's harmony markers are some).
    n: number of completions of the prompt (they share the prompt's KV blocks).
    logprobs: also return, per generated token, the log-probabilities of the chosen token and of
        the `logprobs` most likely ones, from the model's raw distribution (None: off).
    logit_bias: {token id: bias in [-100, 100]}, added to those logits before sampling, as OpenAI's
        (-100 in effect bans a token, +100 all but forces it).
    allowed_token_ids: only these tokens may be sampled (None: all), as vLLM's.
    structured_outputs: a StructuredOutputsParams the completion must satisfy (None: free text).
        Not with min_tokens (a finished grammar allows only EOS, which min_tokens forbids).
    prompt_logprobs: also return, per prompt token, its log-probability given the tokens before it
        and the `prompt_logprobs` most likely ones (None for the first token; None: off). Such a
        request computes its whole prompt (no prefix-cache read).
    seed: makes this request's samples reproducible whatever else shares its batch (None: drawn
        from the engine's RNG). Exact on CPU in float32; on a GPU the logits depend on the batch
        (cuBLAS picks kernels by row count; CUDA graphs pad it): a token at a draw's boundary may differ.
    """
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seed: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | tuple[int, ...] | None = None
    structured_outputs: "StructuredOutputsParams | None" = None

    def __post_init__(self):
        self._check_numbers()
        self._check_stops()
        self._check_token_choices()

    def _number(self, name: str, low: float, high: float, low_open: bool = False, high_open: bool = False):
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"SamplingParams.{name} must be a number, got {value!r}")
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if math.isnan(value) or too_low or too_high:
            interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
            raise ValueError(f"SamplingParams.{name} must be in {interval}, got {value}")

    def _integer(self, name: str, low: int, allow_none: bool = False):
        value = getattr(self, name)
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"SamplingParams.{name} must be an int, got {value!r}")
        if value < low:
            raise ValueError(f"SamplingParams.{name} must be >= {low}, got {value}")

    def _check_numbers(self):
        self._number("temperature", 0.0, math.inf, high_open=True)
        self._integer("top_k", -1)
        if self.top_k == 0:
            raise ValueError("SamplingParams.top_k must be -1 (disabled) or >= 1, got 0")
        self._number("top_p", 0.0, 1.0, low_open=True)
        self._number("min_p", 0.0, 1.0)
        self._number("presence_penalty", -2.0, 2.0)
        self._number("frequency_penalty", -2.0, 2.0)
        self._number("repetition_penalty", 0.0, math.inf, low_open=True, high_open=True)
        self._integer("max_tokens", 1)
        self._integer("min_tokens", 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        self._integer("n", 1)
        self._integer("logprobs", 0, allow_none=True)
        self._integer("prompt_logprobs", 0, allow_none=True)
        self._integer("seed", 0, allow_none=True)
        if self.seed is not None and self.seed >= 2**63:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**63), got {self.seed}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r}")

    def _check_stops(self):
        """stop and stop_token_ids, kept as tuples (the caller's list changed later cannot change them)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"SamplingParams.stop must be a non-empty string or a list of them, got {self.stop!r}")
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple, set)) or not all(is_token_id(t) for t in ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(operator.index(t) for t in ids))

    def _check_token_choices(self):
        """logit_bias, allowed_token_ids and structured_outputs: what changes which tokens may come."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"SamplingParams.logit_bias must be a dict {{token id: bias}}, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                if not is_token_id(token):
                    raise ValueError(f"SamplingParams.logit_bias has key {token!r}: keys must be token ids >= 0")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                    raise ValueError(f"SamplingParams.logit_bias[{token}] must be a number in [-100, 100], got {bias!r}")
            object.__setattr__(self, "logit_bias", {operator.index(t): float(b) for t, b in self.logit_bias.items()})
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if not isinstance(allowed, (list, tuple)) or not allowed or not all(is_token_id(t) for t in allowed):
                raise ValueError(f"SamplingParams.allowed_token_ids must be a non-empty list of token ids >= 0, got "
                                 f"{allowed!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(operator.index(t) for t in allowed))
        if self.structured_outputs is not None:
            from nanovllm.features.structured_params import StructuredOutputsParams  # (their layer: loaded when used)
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise TypeError(f"SamplingParams.structured_outputs must be a StructuredOutputsParams, got "
                                f"{self.structured_outputs!r}")
            if self.min_tokens:
                raise ValueError("SamplingParams.min_tokens cannot be combined with structured_outputs (once the "
                                 "grammar is complete only EOS may follow)")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.stop

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def is_integer(value) -> bool:
    """An int or an integer-like value such as numpy's int64 (tokenizers return those), but not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
        return True
    except TypeError:
        return False


def is_token_id(value) -> bool:
    return is_integer(value) and operator.index(value) >= 0


def __getattr__(name: str):
    """StructuredOutputsParams, from structured outputs' layer at first use (PEP 562; also nanovllm.__getattr__)."""
    if name == "StructuredOutputsParams":
        from nanovllm.features.structured_params import StructuredOutputsParams
        return StructuredOutputsParams
    raise AttributeError(f"nanovllm has no attribute {name!r}")
