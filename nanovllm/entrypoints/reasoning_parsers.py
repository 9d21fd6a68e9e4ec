"""Reasoning models write their thinking before the answer; `--reasoning-parser NAME` (vLLM's flag)
returns it apart, as `reasoning_content` (also when streaming). One class per format (`openai_gptoss`:
gpt-oss's harmony channels, GptOssReasoningParser); `qwen3` (also DeepSeek-R1's and Qwen3.5's) is a
`<think>...</think>` block at the start of the completion:

    <think>
    The user asks ... </think>

    The answer.

A chat template may open the block itself (Qwen3-*-Thinking-2507 and DeepSeek-R1-0528 end their generation
prompt with `<think>\n`): the completion then begins inside it (`started`): all up to `</think>` is reasoning.
"""

PROMPT_TAIL_TOKENS = 32  # the prompt's last tokens read for an opened block (its tag and newlines, any tokenizer)


def cut_tag(text: str, tag: str) -> int:
    """The length of the longest proper prefix of tag that text ends with (0: none): a tag maybe cut off."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


class Qwen3ReasoningParser:
    start, end = "<think>", "</think>"
    keeps_special_tokens = False  # (whether its tags are special tokens, which the text must keep)

    def may_begin(self, text: str) -> bool:
        """Whether text may yet become the opening of a block (or of the content, where that has a tag)."""
        return self.start.startswith(text)

    def opened_by(self, prompt_tail: str) -> bool:
        """Whether a prompt ending with this text leaves the completion inside a reasoning block."""
        return prompt_tail.rstrip().endswith(self.start)

    def split(self, text: str, started: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished completion: one that opens with <think> (or started inside)
        has its reasoning up to </think>, or to its end if it never closes the block; any other is content."""
        if started:
            text = self.start + text
        if not text.startswith(self.start):
            return None, text or None
        reasoning, _, content = text[len(self.start):].partition(self.end)
        return reasoning.strip("\n") or None, content.lstrip("\n") or None


class ReasoningStream:
    """One choice's text split as it streams: push() each delta for its (reasoning, content) deltas, which
    add up to split() of the whole text; what may yet change (a cut tag, newlines before </think>) waits."""

    def __init__(self, parser: Qwen3ReasoningParser, started: bool = False):
        # (a block the prompt opened reads as one the completion opened: the text starts with the tag)
        self.parser, self.text, self.sent_reasoning, self.sent_content = parser, parser.start if started else "", 0, 0

    def push(self, delta: str, finished: bool) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self._known(finished)
        new = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return new

    def _known(self, finished: bool) -> tuple[str, str]:
        """The (reasoning, content) that split() of the text, or of any continuation (not finished), starts with."""
        p, text = self.parser, self.text
        if not finished:
            if p.may_begin(text):
                return "", ""  # (it may be opening a block)
            body = text[len(p.start):]
            if text.startswith(p.start) and p.end not in body:  # (the block goes on: hold back a cut tag)
                return body[:len(body) - cut_tag(body, p.end)].strip("\n"), ""
        return tuple(part or "" for part in p.split(text))


class GptOssReasoningParser(Qwen3ReasoningParser):
    """gpt-oss's harmony format: the completion (after the template's `<|start|>assistant`) is

        <|channel|>analysis<|message|>REASONING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER

    (its `<|return|>` is a stop token: not in the text), or the final channel alone. The markers are
    special tokens, so these requests keep them in their text (skip_special_tokens=False). Not read
    here: tool calls and preambles (the commentary channel), which stay in the content as written.
    """
    start = "<|channel|>analysis<|message|>"
    end = "<|end|><|start|>assistant<|channel|>final<|message|>"
    final = "<|channel|>final<|message|>"
    keeps_special_tokens = True

    def opened_by(self, prompt_tail: str) -> bool:
        return False  # (the template ends with <|start|>assistant: the model names the channel itself)

    def may_begin(self, text: str) -> bool:
        return self.start.startswith(text) or self.final.startswith(text)

    def split(self, text: str, started: bool = False) -> tuple[str | None, str | None]:
        if text.startswith(self.final):  # (no reasoning: the final channel at once)
            return None, text[len(self.final):] or None
        return super().split(text, started)


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "openai_gptoss": GptOssReasoningParser}
