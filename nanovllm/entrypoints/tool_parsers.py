"""Tool calling's model-side format: how a model writes a call in its text, and the grammar that
makes it write one (tool_choice "required" or a named function). One class per format, named as
vLLM's --tool-call-parser; `hermes` is the one Qwen2.5 and Qwen3 templates teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""
import json
import re
import uuid
from dataclasses import dataclass

from nanovllm.features.json_schema import check_schema, rebase_refs
from nanovllm.features.structured_outputs import json_grammar
from nanovllm.entrypoints.reasoning_parsers import cut_tag


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it

    def as_api(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class HermesToolParser:
    start, end = "<tool_call>", "</tool_call>"
    CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The text outside the calls, as written (None when nothing is left), and the calls, in order."""
        calls, kept, last = [], [], 0
        for match in self.CALL.finditer(text):
            if (call := self._call(match.group(1))) is not None:
                calls.append(call)
                kept.append(text[last:match.start()])
                last = match.end()
        kept.append(text[last:])
        return ("".join(kept) if calls else text) or None, calls

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        """The call a block holds: a JSON object with a string `name` and object `arguments` (or its JSON
        text). Else None, never an exception: the block stays in the text, as in vLLM's hermes parser."""
        value = _json_or_none(body)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _json_or_none(arguments)
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))

    def held_back(self, text: str) -> int:
        """Where in text so far a call (or a prefix of its start tag) may begin; len(text): nowhere yet."""
        found = text.find(self.start)
        return found if found >= 0 else len(text) - cut_tag(text, self.start)

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """EBNF for one call (several in a row when parallel) of one of these OpenAI {"name", "parameters"}
        functions. Each one's parameters stand in the schema's $defs, their $refs ("#/$defs/City") re-pointed
        there: xgrammar resolves a $ref through objects only, not anyOf's list. A ValueError names a bad tool."""
        for tool in tools:
            try:
                check_schema(tool.get("parameters") or {"type": "object"})
            except ValueError as e:
                raise ValueError(f"the parameters of {tool['name']!r}: {e}") from e
        schema = {"$defs": {f"tool{i}": rebase_refs(tool.get("parameters") or {"type": "object"}, f"/$defs/tool{i}")
                            for i, tool in enumerate(tools)},
                  "anyOf": [{"type": "object", "properties": {"name": {"const": tool["name"]},
                                                              "arguments": {"$ref": f"#/$defs/tool{i}"}},
                             "required": ["name", "arguments"], "additionalProperties": False}
                            for i, tool in enumerate(tools)]}
        calls = 'call ("\\n" call)*' if parallel else "call"
        return (f"root ::= {calls}\n"
                f'call ::= "{self.start}\\n" call_json "\\n{self.end}"\n' + json_grammar(schema, root="call_json"))


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # (JSONDecodeError is a ValueError; RecursionError: nested too deeply)
        return None


TOOL_PARSERS = {"hermes": HermesToolParser}
