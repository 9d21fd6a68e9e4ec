from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How to sample one request's completion; validated once, at construction.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it before softmax.
    top_k: keep the k most likely tokens (-1: all).  top_p: keep the smallest set of tokens whose
    probability reaches p (1.0: all).  max_tokens: completion length cap (at least 1).
    ignore_eos: keep generating past EOS (benchmarks).  seed: makes this request's samples
    reproducible whatever else shares its batch (None: a seed is drawn from the engine's RNG).
    """
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        def check_int(name, value):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SamplingParams.{name} must be an int, got {value!r}")

        def check_number(name, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"SamplingParams.{name} must be a number, got {value!r}")

        check_number("temperature", self.temperature)
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"SamplingParams.temperature must be >= 0 and finite, got {self.temperature}")
        check_int("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None:
            check_int("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise ValueError(f"SamplingParams.seed must be in [0, 2**63), got {self.seed}")
