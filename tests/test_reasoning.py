"""--reasoning-parser qwen3: a completion's <think>...</think> block returned as the message's
reasoning_content (delta.reasoning_content when streaming, the deltas adding up to the whole,
however the text is cut), with tool calls parsed from the rest; a server that has it serves
plain answers unchanged, and holds a constrained output (response_format, a required tool call)
after the reasoning block, which the grammar lets the model write freely."""
import json
import random
import tempfile

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")

from nanovllm.entrypoints.api_server import ChatChoices  # noqa: E402
from nanovllm.entrypoints.protocol import ChatCompletionRequest  # noqa: E402
from nanovllm.entrypoints.reasoning_parsers import (GptOssReasoningParser, Qwen3ReasoningParser,  # noqa: E402
                                                    ReasoningStream)
from nanovllm.entrypoints.tool_parsers import HermesToolParser  # noqa: E402
from nanovllm.utils.tiny_model import CHATML_TEMPLATE, build_model, build_tokenizer  # noqa: E402
from serving import KEY, error_of, http, module_server, openai_client  # noqa: E402

TEXTS = ["<think>\nThe user wants a number.\n\n</think>\n\n42.", "<think>never closed", "plain answer",
         "<thi", "<think></think>x", "<think>a</thinkless</think>b", "\n<think>not at the start</think>"]


def test_split():
    p = Qwen3ReasoningParser()
    assert p.split(TEXTS[0]) == ("The user wants a number.", "42.")
    assert p.split(TEXTS[1]) == ("never closed", None)
    assert p.split(TEXTS[2]) == (None, "plain answer")
    assert p.split(TEXTS[4]) == (None, "x")
    assert p.split(TEXTS[5]) == ("a</thinkless", "b")
    assert p.split(TEXTS[6]) == (None, TEXTS[6])


def test_split_of_a_block_the_prompt_opened():
    """A template that ends its generation prompt with <think> (Qwen3-Thinking-2507, DeepSeek-R1-0528)
    leaves the completion inside the block: what comes before </think> is reasoning."""
    p = Qwen3ReasoningParser()
    assert p.split("because</think>\n\nanswer", started=True) == ("because", "answer")
    assert p.split("\nstill thinking", started=True) == ("still thinking", None)
    assert p.split("</think>answer", started=True) == (None, "answer")
    assert p.opened_by("<|im_start|>assistant\n<think>\n") and p.opened_by("<think>")
    assert not p.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not p.opened_by("assistant\n")


HARMONY = ["<|channel|>analysis<|message|>The user asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>4.",
           "<|channel|>final<|message|>4.", "<|channel|>analysis<|message|>still thinking", "<|channel|>fin",
           "<|channel|>commentary<|message|>a preamble"]


def test_harmony_split():
    """openai_gptoss: the analysis channel is the reasoning, the final channel the content."""
    p = GptOssReasoningParser()
    assert p.split(HARMONY[0]) == ("The user asks 2+2.", "4.")
    assert p.split(HARMONY[1]) == (None, "4.")
    assert p.split(HARMONY[2]) == ("still thinking", None)
    assert p.split(HARMONY[4]) == (None, HARMONY[4])  # (the commentary channel is not read: left as written)
    assert p.keeps_special_tokens and not Qwen3ReasoningParser.keeps_special_tokens
    assert not p.opened_by("<|start|>user<|message|>x<|end|><|start|>assistant")


@pytest.mark.parametrize("parser, text, started", [(Qwen3ReasoningParser(), t, s) for t in TEXTS + [
    "because</think>\n\nanswer"] for s in (False, True)] + [(GptOssReasoningParser(), t, False) for t in HARMONY])
def test_streamed_deltas_add_up_to_the_split_however_cut(parser, text, started):
    rng = random.Random(0)
    expected = tuple(part or "" for part in parser.split(text, started))
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), min(rng.randint(0, 6), len(text) - 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream, got = ReasoningStream(parser, started), ["", ""]
        for i, piece in enumerate(pieces):
            reasoning, content = stream.push(piece, i == len(pieces) - 1)
            got[0] += reasoning
            got[1] += content
        assert tuple(got) == expected, pieces


@pytest.mark.parametrize("parser, body, skip", [(GptOssReasoningParser(), {}, False), (Qwen3ReasoningParser(), {}, True),
                                               (None, {}, True), (None, {"skip_special_tokens": False}, False)])
def test_a_parser_whose_tags_are_special_tokens_keeps_them_in_the_text(parser, body, skip):
    """(harmony's markers are special tokens: decoded without them, the text could not be split.)"""
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    request.use_parsers(None, parser)
    assert request.sampling_params(None).skip_special_tokens is skip


def choices(**body) -> ChatChoices:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    request.use_parsers(HermesToolParser())
    return ChatChoices([], request, "m", None, reasoning_parser=Qwen3ReasoningParser())


def test_reasoning_and_tool_calls_in_one_message():
    text = '<think>I should call it.</think>\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "f"}}]
    content, reason = choices(tools=tools).final(text, "stop")
    message = content["message"]
    assert message["reasoning_content"] == "I should call it." and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'} and reason == "tool_calls"
    streamed = choices(tools=tools)
    deltas = [streamed.stream_piece(0, piece, i == 3, "stop" if i == 3 else None)
              for i, piece in enumerate([text[:10], text[10:30], text[30:60], text[60:]])]
    assert "".join(d[1].get("reasoning_content", "") for d in deltas) == "I should call it."
    assert "".join(d[0] for d in deltas) == "" and deltas[-1][2] == "tool_calls"
    assert deltas[-1][1]["tool_calls"][0]["function"]["name"] == "f"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_model(str(tmp_path_factory.mktemp("reasoning")), chat_template=True)
    yield from module_server(model, tmp_path_factory, "--api-key", KEY, "--reasoning-parser", "qwen3",
                             max_model_len=512)


def test_a_server_with_the_parser(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    out = http(server, "POST", "/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert out["content"] and out.get("reasoning_content") is None  # (random weights write no <think>)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    thinking = http(server, "POST", "/v1/chat/completions", json={**body, "max_tokens": 30,
                                                                 "response_format": response_format})
    message = thinking.json()["choices"][0]["message"]  # (greedy, this model opens a reasoning block)
    assert message["reasoning_content"] and message["content"] is None
    # with "<" banned it cannot open one: the answer is the constrained JSON from the first token
    less_than = build_tokenizer(tempfile.mkdtemp()).convert_tokens_to_ids("<")
    direct = http(server, "POST", "/v1/chat/completions", json={
        **body, "max_tokens": 60, "response_format": response_format, "logit_bias": {str(less_than): -100}})
    choice = direct.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and set(json.loads(choice["message"]["content"])) == {"n"}


def test_a_constraint_holds_after_the_reasoning_block():
    """StructuredOutputsParams(reasoning=(start, end)): an optional reasoning block of any text
    without the end tag, then the constrained answer (what --reasoning-parser asks for)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from nanovllm import StructuredOutputsParams
    from nanovllm.features.structured_outputs import Grammars
    tokenizer = AutoTokenizer.from_pretrained(build_model(tempfile.mkdtemp()))
    grammars = Grammars(tokenizer, 512, {tokenizer.eos_token_id})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compiled = grammars.compile(StructuredOutputsParams(json=schema, reasoning=("<think>", "</think>")))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)
    assert accepts('<think>Let me see: </thinker> is not the end, nor is < / think.</think>\n\n{"a": 1}')
    assert accepts('{"a": 2}') and accepts('<think></think>{"a": 3}')
    assert not accepts('<think>x</think>free text') and not accepts('<think>x</think>{"a": 1}</think>')
    assert not accepts("<think>never closed") and not accepts('{"b": 1}')


def test_a_constraint_after_a_block_the_prompt_opened():
    """reasoning_started: the completion begins inside the block, and must close it before the answer."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from nanovllm import StructuredOutputsParams
    from nanovllm.features.structured_outputs import Grammars
    tokenizer = AutoTokenizer.from_pretrained(build_model(tempfile.mkdtemp()))
    grammars = Grammars(tokenizer, 512, {tokenizer.eos_token_id})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compiled = grammars.compile(StructuredOutputsParams(json=schema, reasoning=("<think>", "</think>"),
                                                        reasoning_started=True))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)
    assert accepts('because</think>\n\n{"a": 1}') and accepts('</think>{"a": 2}')
    assert not accepts('{"a": 1}') and not accepts('x</think>{"a": 1}</think>')
    with pytest.raises(TypeError, match="reasoning_started"):
        StructuredOutputsParams(json=schema, reasoning_started=True)


# A ChatML template that opens the reasoning block in its generation prompt, as Qwen3-*-Thinking-2507's
# does, unless the request's chat_template_kwargs turn thinking off (Qwen3's enable_thinking).
THINKING_TEMPLATE = CHATML_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    from transformers import AutoTokenizer
    model = build_model(str(tmp_path_factory.mktemp("thinking")), chat_template=True)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(model)
    yield from module_server(model, tmp_path_factory, "--api-key", KEY, "--reasoning-parser", "qwen3",
                             "--served-model-name", "thinking", max_model_len=512)


HI = [{"role": "user", "content": "hi"}]


def test_a_block_the_template_opened_is_reasoning_whole_and_streamed(thinking_server):
    client = openai_client(thinking_server)
    body = dict(model="thinking", messages=HI, max_tokens=12, temperature=0)
    message = client.chat.completions.create(**body).choices[0].message
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"  # (as the template renders HI)
    text = client.completions.create(model="thinking", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    assert message.reasoning_content == text.strip("\n") and message.content is None  # (never closed)
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **body):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert reasoning == message.reasoning_content and content == ""


def test_chat_template_kwargs_reach_the_template(thinking_server):
    """enable_thinking false: the template closes the block itself, and the completion is content."""
    client = openai_client(thinking_server)
    body = dict(model="thinking", messages=HI, max_tokens=12, temperature=0)
    off = client.chat.completions.create(**body, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = client.chat.completions.create(**body)
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # ("\n</think>\n\n" more)
    assert off.choices[0].message.content and getattr(off.choices[0].message, "reasoning_content", None) is None
    for kwargs, key in (({"tokenize": True}, "tokenize"), ({"enable_thinkng": False}, "enable_thinkng"),
                        ({"messages": []}, "messages"), ({"eos_token": "x"}, "eos_token")):
        error = error_of(http(thinking_server, "POST", "/v1/chat/completions",
                              json={**body, "chat_template_kwargs": kwargs}), 400)
        assert error["param"] == "chat_template_kwargs" and repr(key) in error["message"] \
            and "enable_thinking" in error["message"], error


def test_the_reasoning_block_is_part_of_a_constraints_cache_key():
    """The same schema with and without a reasoning block are two constraints (unequal: the
    grammar cache keeps them apart), compiled to two grammars: without it, "<think>" cannot open
    the answer. (A server with --reasoning-parser asks for chat's with it, completions' without.)"""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from nanovllm import StructuredOutputsParams
    from nanovllm.features.structured_outputs import Grammars
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    plain = StructuredOutputsParams(json=schema)
    thinking = StructuredOutputsParams(json=schema, reasoning=("<think>", "</think>"))
    assert plain != thinking and len({plain, thinking}) == 2
    assert plain == StructuredOutputsParams(json=schema) and hash(plain) == hash(StructuredOutputsParams(json=schema))
    tokenizer = AutoTokenizer.from_pretrained(build_model(tempfile.mkdtemp()))
    grammars = Grammars(tokenizer, 512, {tokenizer.eos_token_id})

    def accepts(compiled, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)
    with_block, without = grammars.compile(thinking), grammars.compile(plain)  # (in this order: a cache hit would
    assert accepts(with_block, '<think>x</think>{"a": 1}')                     # give the first one back)
    assert accepts(without, '{"a": 1}') and not accepts(without, '<think>x</think>{"a": 1}')


def test_completions_and_chat_with_one_schema_on_a_server_with_the_parser(server):
    """On a server with --reasoning-parser, chat's constraint allows a reasoning block first and
    completions' does not, for the same schema, in either order (each gets its own grammar, not
    the other's from the cache). Greedy, the chat prompt opens a reasoning block where it may
    (test_a_server_with_the_parser); the completion, with "<" pushed up by logit_bias, could open
    one only if its grammar allowed it."""
    less_than = build_tokenizer(tempfile.mkdtemp()).convert_tokens_to_ids("<")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "temperature": 0}
    completion = {"prompt": "hi there", "max_tokens": 60, "temperature": 0, "logit_bias": {str(less_than): 50}}
    for maximum, chat_first in [(7, False), (8, True)]:  # (schemas no other test compiles)
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": maximum}},
                  "required": ["n"], "additionalProperties": False}
        response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}

        def ask_chat():
            message = http(server, "POST", "/v1/chat/completions",
                           json={**chat, "response_format": response_format}).json()["choices"][0]["message"]
            assert message["reasoning_content"] and message["content"] is None, (maximum, message)

        def ask_completions():
            choice = http(server, "POST", "/v1/completions",
                          json={**completion, "response_format": response_format}).json()["choices"][0]
            assert choice["finish_reason"] == "stop", (maximum, choice)
            assert 0 <= json.loads(choice["text"])["n"] <= maximum, (maximum, choice)
        for ask in (ask_chat, ask_completions) if chat_first else (ask_completions, ask_chat):
            ask()
