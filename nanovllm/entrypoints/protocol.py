"""The request bodies of the OpenAI API that the server takes (with vLLM's sampling extras), and
how they become SamplingParams. Fields the server does not use are ignored, as OpenAI's are."""
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from nanovllm.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # as OpenAI's top_logprobs (and vLLM's default max_logprobs)
MAX_N = 128        # completions per prompt, as OpenAI allows: each is a sequence the engine runs
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI and vLLM


class BadRequest(ValueError):
    """A request the API refuses: a 400 naming the parameter."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields completions and chat completions share."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False

    def sampling_params(self, max_tokens: int | None, num_logprobs: int | None) -> SamplingParams:
        """SamplingParams of this request (max_tokens None: a placeholder the engine replaces by
        what the prompt leaves of the context). Bad values are a BadRequest naming the field."""
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                                          "frequency_penalty", "repetition_penalty")
                 if getattr(self, name) is not None}
        try:
            return SamplingParams(
                **given, n=self.n, stop=self.stop, seed=self.seed, min_tokens=self.min_tokens,
                max_tokens=max_tokens if max_tokens is not None else max(1, self.min_tokens),
                ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=num_logprobs)
        except (ValueError, TypeError) as e:
            message = str(e)
            param = message.split("SamplingParams.", 1)[1].split(" ", 1)[0].split("=", 1)[0] \
                if "SamplingParams." in message else None
            raise BadRequest(message.replace("SamplingParams.", ""), param) from e


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_TOKENS  # (null: up to max_model_len)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s): one string, strings, token ids, or lists of token ids."""
        if self.echo:
            raise BadRequest("echo is not supported", "echo")
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool calls, ...: passed on to the template
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def as_template_input(self) -> dict:
        """The message as a chat template takes it: content parts of type "text" joined."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"only text content parts are supported, got {part.get('type')!r}", "messages")
                parts.append(part["text"])
            message["content"] = "".join(parts)
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs to be true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
