"""The request bodies of the OpenAI API that the server takes (with vLLM's sampling extras): how a body
is parsed (`parse_body`: every mistake a BadRequest naming the field) and how it becomes SamplingParams.
A field the server does not support (suffix, best_of, functions, ...) is a 400 naming it, never silently
ignored; chat messages may carry any field (name, tool_calls, ...), passed on to the chat template.
Types are strict, as the API's schema says: `"max_tokens": "5"` or a token id `false` is refused, not
coerced (an int where a float is expected is fine).
"""
import dataclasses
import json
import re
import sys
from typing import Annotated, ClassVar, Literal, TypeVar, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, TypeAdapter, ValidationError,
                      WithJsonSchema)

from nanovllm.features.structured_outputs import check_length, check_schema_size, xgrammar_message
from nanovllm.entrypoints.reasoning_parsers import PROMPT_TAIL_TOKENS
from nanovllm.features.structured_params import StructuredOutputsParams
from nanovllm.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # as OpenAI's top_logprobs (and vLLM's default max_logprobs)
# Stop strings are searched for in every sequence's new text at every step (on the engine thread). OpenAI
# takes 4, vLLM 4 by default (VLLM_MAX_STOP_STRINGS); 16 leaves room for lm-eval's longer `until` lists.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_N = 128        # completions per prompt, as OpenAI allows: each is a sequence the engine runs
# The prompt logprobs one call's echo may return (prompt tokens x n x (logprobs + 1)): ~7 MB of JSON.
# lm-eval's loglikelihood requests (n 1, logprobs 0 or 1) stay far below it; 1,000 tokens x n 128 x 21 do not.
MAX_ECHO_LOGPROBS = 2**18
DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI and vLLM


class BadRequest(ValueError):
    """A request the API refuses: a 4xx (400 unless said otherwise) naming the parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


STRICT = ConfigDict(extra="forbid", strict=True)
# A token id as a JSON object key (logit_bias): ASCII digits, no sign, space, underscore or leading zero,
# at most 10 digits (int() takes all of those, Arabic-Indic digits too, and 5,000 digits slowly).
TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")


def shorten(text: str, limit: int = 40) -> str:
    """text as an error message quotes it: at most limit characters."""
    return text if len(text) <= limit else text[:limit] + "..."


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # (the schema is always enforced: constrained decoding)


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON valid against a schema."""
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's structured_outputs extra: exactly one of these (StructuredOutputsParams)."""
    model_config = STRICT
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(BaseModel):
    """The fields completions and chat completions share."""
    model_config = STRICT
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
    user: str | None = None  # OpenAI's end-user id (for a provider's abuse monitoring): taken, changes nothing
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # (False with a --reasoning-parser whose tags are special tokens)
    structured_outputs: StructuredOutputsRequest | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token ids (as JSON object keys) -> bias
    allowed_token_ids: list[int] | None = None  # vLLM's

    # the names of this endpoint's fields, for errors (chat overrides them)
    prompt_field: ClassVar[str] = "prompt"
    max_tokens_field: ClassVar[str] = "max_tokens"
    _reasoning_parser = PrivateAttr(default=None)  # the server's --reasoning-parser, for chat
    _reasoning_started = PrivateAttr(default=False)  # the rendered prompt opened a reasoning block (chat)
    _tool_parser = PrivateAttr(default=None)  # the server's --tool-call-parser (chat)

    def use_parsers(self, tool_parser=None, reasoning_parser=None, reasoning_started: bool = False):
        """The server's parsers (--tool-call-parser, --reasoning-parser), set by the endpoint."""
        self._tool_parser, self._reasoning_parser, self._reasoning_started = (tool_parser, reasoning_parser,
                                                                              reasoning_started)

    @property
    def tool_parser(self):
        return self._tool_parser

    @property
    def reasoning_started(self) -> bool:
        return self._reasoning_started

    def completion_limit(self) -> int | None:
        """The most tokens to generate per sample (None: what the prompt leaves of max_model_len)."""
        return self.max_tokens

    def prompt_logprobs(self) -> int | None:
        """How many top logprobs per prompt token the response needs (None: none)."""
        return None

    def sampling_params(self, num_logprobs: int | None) -> SamplingParams:
        """SamplingParams of this request (no completion limit: max_tokens is a placeholder the server replaces)."""
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        max_tokens = self.completion_limit()
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"{self.max_tokens_field} must be at least 1, got {max_tokens}", self.max_tokens_field)
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                                          "frequency_penalty", "repetition_penalty")
                 if getattr(self, name) is not None}
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise BadRequest(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
        if (longest := max(map(len, stops), default=0)) > MAX_STOP_STRING_CHARS:
            raise BadRequest(f"stop has a string of {longest} characters; at most {MAX_STOP_STRING_CHARS} are allowed",
                             "stop")
        constraint = self.structured_constraint()
        if constraint is not None and self._reasoning_parser is not None:  # (--reasoning-parser: after the reasoning)
            constraint = dataclasses.replace(constraint, reasoning=(self._reasoning_parser.start,
                                                                    self._reasoning_parser.end))
        logit_bias = None
        if self.logit_bias is not None:
            bad = next((key for key in self.logit_bias if not TOKEN_ID_KEY.fullmatch(key)), None)
            if bad is not None:
                raise BadRequest(f"logit_bias keys must be token ids in plain decimal (such as \"42\"), got "
                                 f"{shorten(bad)!r}", "logit_bias")
            logit_bias = {int(token): bias for token, bias in self.logit_bias.items()}
        try:
            return SamplingParams(
                **given, n=self.n, stop=self.stop, seed=self.seed, min_tokens=self.min_tokens,
                max_tokens=max_tokens if max_tokens is not None else max(1, self.min_tokens),
                ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=num_logprobs,
                skip_special_tokens=self.skip_special_tokens and not getattr(self._reasoning_parser,
                                                                             "keeps_special_tokens", False),
                logit_bias=logit_bias, allowed_token_ids=self.allowed_token_ids, structured_outputs=constraint,
                prompt_logprobs=self.prompt_logprobs())
        except (ValueError, TypeError) as e:
            raise self.bad_request(e) from e

    def for_prompts(self, params: SamplingParams, prompt_token_ids: list[list[int]], tokenizer) -> SamplingParams:
        """params for the prompts as tokenized (chat: its one prompt, as its template rendered it)."""
        return params

    def requires_tool_call(self) -> bool:
        """Whether the output must be a tool call (chat's tool_choice "required" or a function)."""
        return False

    @property
    def structured_field(self) -> str:
        """The field the output constraint came in (for errors)."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def structured_constraint(self) -> StructuredOutputsParams | None:
        """response_format (OpenAI's) or structured_outputs (vLLM's) as StructuredOutputsParams (None: free text)."""
        fmt, extra = self.response_format, self.structured_outputs
        if fmt is not None and extra is not None and fmt.type != "text":
            raise BadRequest("give response_format or structured_outputs, not both", "structured_outputs")
        try:
            if extra is not None:
                return StructuredOutputsParams(json=extra.json_, regex=extra.regex, choice=extra.choice,
                                               grammar=extra.grammar, json_object=bool(extra.json_object))
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise BadRequest("response_format of type json_schema needs json_schema.schema", "response_format")
            return StructuredOutputsParams(json=fmt.json_schema.schema_)
        except (ValueError, TypeError) as e:
            if isinstance(e, BadRequest):
                raise
            raise BadRequest(f"{self.structured_field}: {str(e).replace('StructuredOutputsParams.', '')}",
                             self.structured_field) from e

    def bad_request(self, error: Exception) -> BadRequest:
        """The engine's or SamplingParams' error (naming `SamplingParams.<name>`) as this endpoint's BadRequest."""
        message, param = str(error), None
        named = re.search(r"SamplingParams\.(\w+)", message)
        if named is not None:
            param, message = named.group(1), message.replace("SamplingParams.", "")
        if param == "max_tokens" and self.max_tokens_field != "max_tokens":
            param, message = self.max_tokens_field, message.replace("max_tokens", self.max_tokens_field)
        return BadRequest(message, param)


def prompt_form(value) -> str:
    """Which of completions' prompt forms a value is meant as, from its first element: so that a
    million token ids are validated as ints once, not tried as strings first (2.4 s to 0.35 s)."""
    if isinstance(value, list) and value:
        return {str: "texts", list: "id_lists"}.get(type(value[0]), "ids")
    return "ids" if isinstance(value, list) else "text"


Prompt = Annotated[
    Union[Annotated[str, Tag("text")], Annotated[list[str], Tag("texts")],  # noqa: UP007 (Tag needs Union)
          Annotated[list[int], Tag("ids")], Annotated[list[list[int]], Tag("id_lists")]],
    Discriminator(prompt_form),  # (the OpenAPI document keeps the plain anyOf)
    WithJsonSchema({"anyOf": [TypeAdapter(form).json_schema() for form in (str, list[str], list[int], list[list[int]])]})]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""
    prompt: Prompt
    max_tokens: int | None = DEFAULT_COMPLETION_TOKENS  # (null: up to max_model_len)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (lm-eval's loglikelihood): the prompt alone (the token generated is left out)."""
        return self.echo and self.max_tokens == 0

    def completion_limit(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def for_prompts(self, params: SamplingParams, prompt_token_ids: list[list[int]], tokenizer) -> SamplingParams:
        """A BadRequest for echo logprobs beyond MAX_ECHO_LOGPROBS."""
        if self.echo and self.logprobs is not None:
            entries = sum(map(len, prompt_token_ids)) * self.n * (self.logprobs + 1)
            if entries > MAX_ECHO_LOGPROBS:
                raise BadRequest(f"echo with logprobs={self.logprobs} and n={self.n} asks for {entries:,} prompt "
                                 f"logprobs ({sum(map(len, prompt_token_ids)):,} prompt tokens x n x (logprobs + 1)); "
                                 f"at most {MAX_ECHO_LOGPROBS:,} are returned: lower n or logprobs, or shorten the "
                                 f"prompt", "n" if self.n > 1 else "logprobs")
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s): one string, strings, token ids, or lists of token ids."""
        if self.echo and self.stream:
            raise BadRequest("echo is not supported with stream", "echo")
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool calls, ...: passed on to the template
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def as_template_input(self) -> dict:
        """The message as a chat template takes it: text content parts joined, and tool calls' arguments
        as objects (the API sends JSON text; the templates, as transformers documents them, take a dict)."""
        message = self.model_dump(exclude_none=True)
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # (left as the text it is)
        if isinstance(self.content, list):
            for part in self.content:
                if part.get("type") == "image_url":  # (decoded with the prompt: features/multimodal.py)
                    if not isinstance(part.get("image_url"), dict) or not isinstance(part["image_url"].get("url"), str):
                        raise BadRequest("an image_url content part needs {'url': a string}", "messages")
                    if set(part["image_url"]) - {"url", "detail"} or set(part) - {"type", "image_url"}:
                        raise BadRequest(f"an image_url content part takes {{'type', 'image_url': {{'url', 'detail'}}}}, "
                                         f"got {part}", "messages")
                elif part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(f"content parts must be text or image_url, got {part.get('type')!r}", "messages")
            if all(part["type"] == "text" for part in self.content):  # (text alone: one string, as every template takes)
                message["content"] = "".join(part["text"] for part in self.content)
        return message


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None      # (the arguments are always held to it when a call is required)


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None  # vLLM's: more variables of the chat template (enable_thinking)
    prompt_field: ClassVar[str] = "messages"

    def tool_definitions(self) -> list[dict] | None:
        """The tools as the chat template takes them (OpenAI's shape)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def calls_tools(self) -> bool:
        """Whether the output is parsed for tool calls: tools given, and tool_choice not "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    def requires_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def structured_constraint(self) -> StructuredOutputsParams | None:
        """A required tool call is enforced by the tool parser's grammar; else as for completions."""
        choice = self.tool_choice
        if choice is not None and not self.tools:
            raise BadRequest("tool_choice needs tools", "tool_choice")
        if self.requires_tool_call():
            if (self.response_format is not None and self.response_format.type != "text") or self.structured_outputs:
                raise BadRequest("a required tool call cannot be combined with response_format or "
                                 "structured_outputs", "tool_choice")
            functions = [tool.function.model_dump(exclude_none=True) for tool in self.tools]
            try:  # (the work their grammar may ask for, bounded before it is built)
                for i, function in enumerate(functions):
                    check_schema_size(function.get("parameters") or {}, f"tools.{i}.function.parameters")
                check_length(len(json.dumps([f.get("parameters") for f in functions])), "the tools' parameters")
            except ValueError as e:
                raise BadRequest(str(e), "tools") from e
            if isinstance(choice, NamedToolChoice):
                functions = [f for f in functions if f["name"] == choice.function.name]
                if not functions:
                    raise BadRequest(f"tool_choice names the function {choice.function.name!r}, which is not "
                                     f"among the tools", "tool_choice")
            try:
                return StructuredOutputsParams(grammar=self._tool_parser.grammar(
                    functions, self.parallel_tool_calls and not isinstance(choice, NamedToolChoice)))
            except ValueError as e:  # (check_schema's, naming the tool)
                raise BadRequest(f"tools: {e}", "tools") from e
            except Exception as e:  # a parameters schema xgrammar cannot read
                raise BadRequest(f"tools: a function's parameters are not a JSON schema it can hold a call to: "
                                 f"{xgrammar_message(e)}", "tools") from e
        return super().structured_constraint()

    def for_prompts(self, params: SamplingParams, prompt_token_ids: list[list[int]], tokenizer) -> SamplingParams:
        """With --reasoning-parser: whether the template opened a reasoning block (a constraint holds after it)."""
        parser = self._reasoning_parser
        if parser is None or tokenizer is None:
            return params
        (prompt,) = prompt_token_ids
        self._reasoning_started = parser.opened_by(tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:]))
        constraint = params.structured_outputs
        if self._reasoning_started and constraint is not None:
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(constraint,
                                                                                        reasoning_started=True))
        return params

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs to be true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """Every error the server answers, in OpenAI's shape."""
    error: ErrorInfo


# ---- the bodies of the engine operations (an RL trainer's: api_server's admin endpoints) ---------
class UpdateWeightsFromDiskRequest(BaseModel):
    """POST /update_weights_from_disk: a checkpoint folder (its *.safetensors) of the served model's shapes."""
    model_config = STRICT
    model_path: str


class ResetPrefixCacheRequest(BaseModel):
    """POST /reset_prefix_cache: no fields (the body may be left out)."""
    model_config = STRICT


class SleepRequest(BaseModel):
    """POST /sleep: level 1 keeps the weights in host memory, 2 drops them (reloaded at wake-up)."""
    model_config = STRICT
    level: int = Field(default=1, ge=1, le=2)  # (an int, strictly: a Literal[1, 2] would take true and 1.0)


class WakeUpRequest(BaseModel):
    """POST /wake_up: what to bring back (none given: both)."""
    model_config = STRICT
    tags: list[Literal["weights", "kv_cache"]] | None = Field(default=None, min_length=1)


# ---- parsing a body -----------------------------------------------------------------------------
Body = TypeVar("Body", bound=BaseModel)


def parse_body(raw: bytes, content_type: str | None, model: type[Body]) -> Body:
    """The request `model` that a body holds, or a BadRequest saying what is wrong: not JSON (415), not
    UTF-8, nested too deep, a lone surrogate such as "\\ud800" (not even printable in an error), a bad field."""
    media_type = (content_type or "application/json").split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise BadRequest(f"the body must be JSON (Content-Type: application/json), got {media_type!r}", status=415)
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        field = _too_deep_field(raw)
        raise BadRequest(f"{field or 'the body'} is nested too deeply to parse", field) from None
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not UTF-8: {e.reason} at byte {e.start}") from None
    except ValueError as e:  # (json.JSONDecodeError, the constants refused, an integer of over 4,300 digits)
        if "integer string conversion" in str(e):
            raise BadRequest(f"the body holds an integer of more than {sys.get_int_max_str_digits()} digits") from None
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(data).__name__}")
    if SURROGATE_ESCAPE.search(raw) and (path := _lone_surrogate(data)) is not None:
        raise BadRequest(f"{path} is not valid Unicode: it holds a lone surrogate", path.split(".", 1)[0])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] == "extra_forbidden":
            field = ".".join(map(str, first["loc"]))
            raise BadRequest(f"{field} is not supported by this server", str(first["loc"][0])) from None
        location = [str(part) for part in first["loc"] if isinstance(part, int) or part in FIELD_NAMES]
        raise BadRequest(f"{'.'.join(location) or 'body'}: {first['msg']}", location[0] if location else None) from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _lone_surrogate(data) -> str | None:
    """The path (`messages.0.content`) of the first string or key with a lone surrogate; iterative: JSON nests deep."""
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else key
                if SURROGATE.search(key):  # (escaped: the path goes into the error message)
                    return child.encode("utf-8", "backslashreplace").decode()
                stack.append((child, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", item) for i, item in enumerate(value))
    return None


SURROGATE = re.compile("[\ud800-\udfff]")
# A lone surrogate can reach a parsed body only through an escape (its UTF-8 bytes are not UTF-8):
# a body with none is not walked (a walk of a million token ids took a second and a half).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _too_deep_field(raw: bytes) -> str | None:
    """The top-level field that nests too deeply for json.loads (None: not found), decoding one at a time."""
    decoder, text = json.JSONDecoder(), raw.decode("utf-8", errors="replace")
    space = re.compile(r"\s*")
    try:
        i = space.match(text, text.index("{") + 1).end()
        while text[i] == '"':
            key, i = decoder.raw_decode(text, i)
            i = space.match(text, i).end() + 1  # (past the colon)
            try:
                _, i = decoder.raw_decode(text, space.match(text, i).end())
            except RecursionError:
                return key
            i = space.match(text, space.match(text, i).end() + 1).end()  # (past the comma)
    except (ValueError, IndexError):
        pass
    return None


def inline_schema(model: type[BaseModel]) -> dict:
    """The model's JSON schema with its $defs inlined, for the OpenAPI document (its $refs would point elsewhere)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(definitions[node["$ref"].rsplit("/", 1)[1]])
            return {key: resolve(value) for key, value in node.items()}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node
    return resolve(schema)


FIELD_NAMES = {name for m in (CompletionRequest, ChatCompletionRequest, ChatMessage, StreamOptions, ResponseFormat,
                              JsonSchemaFormat, StructuredOutputsRequest, Tool, FunctionDefinition,
                              NamedToolChoice, NamedFunction, UpdateWeightsFromDiskRequest, SleepRequest,
                              WakeUpRequest)
               for name in m.model_fields} | {"json", "schema"}
