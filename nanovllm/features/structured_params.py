"""StructuredOutputsParams: a request's constraint (SamplingParams.structured_outputs), validated
at construction. Structured outputs' layer (features/structured_outputs.py runs it); `nanovllm`
and `nanovllm.sampling_params` export it, loaded at its first use."""
import json
from dataclasses import dataclass

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the completion, with vLLM's names; exactly one of:
    json: a JSON schema (a dict, or its JSON text): the completion is a JSON value it validates.
    regex: the completion matches this regular expression.
    choice: the completion is one of these strings.
    grammar: the completion is derived from this EBNF grammar (xgrammar's GBNF dialect, rule `root`).
    json_object: the completion is any JSON object.
    reasoning: (start, end) tags of a reasoning block the completion may open with, written freely;
        the constraint holds after it (a reasoning model's answer).
    reasoning_started: the prompt has opened the reasoning block already (a chat template whose
        generation prompt ends with the start tag): the completion begins inside it, and must
        close it before the constrained answer.
    Decoding is constrained token by token (features/structured_outputs.py), so the text is valid
    by construction unless max_tokens cuts it short (finish_reason "length")."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    reasoning: tuple[str, str] | None = None
    reasoning_started: bool = False

    def __post_init__(self):
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams takes exactly one of {list(STRUCTURED_KINDS)}, got "
                             f"{given or 'none'}")
        if self.json is not None:
            try:  # (stored as text: hashable; key order kept: it is the output's)
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                text = json.dumps(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from e
            except RecursionError:
                raise ValueError("StructuredOutputsParams.json is nested too deeply to read") from None
            if not isinstance(schema, (dict, bool)):
                raise TypeError(f"StructuredOutputsParams.json must be a JSON schema (an object), got {self.json!r}")
            object.__setattr__(self, "json", text)
        self._check_kinds_and_reasoning()

    def _check_kinds_and_reasoning(self):
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"StructuredOutputsParams.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise TypeError(f"StructuredOutputsParams.choice must be a non-empty list of non-empty strings, "
                                f"got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise TypeError(f"StructuredOutputsParams.json_object must be a bool, got {self.json_object!r}")
        if self.reasoning is not None:
            if (not isinstance(self.reasoning, (tuple, list)) or len(self.reasoning) != 2
                    or not all(isinstance(tag, str) and tag for tag in self.reasoning)):
                raise TypeError(f"StructuredOutputsParams.reasoning must be (start tag, end tag), "
                                f"got {self.reasoning!r}")
            object.__setattr__(self, "reasoning", tuple(self.reasoning))
        if not isinstance(self.reasoning_started, bool) or (self.reasoning_started and self.reasoning is None):
            raise TypeError(f"StructuredOutputsParams.reasoning_started must be a bool, and True only with reasoning, "
                            f"got {self.reasoning_started!r}")

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False))
