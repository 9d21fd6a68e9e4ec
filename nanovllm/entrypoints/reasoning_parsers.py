"""Reasoning models write their thinking before the answer; `--reasoning-parser NAME` (vLLM's flag)
returns it apart, as the message's `reasoning_content` (and `delta.reasoning_content` when
streaming). One class per format; `qwen3` (also DeepSeek-R1's) is a `<think>...</think>` block
at the start of the completion:

    <think>
    The user asks ... </think>

    The answer.

A chat template may open the block itself (Qwen3-*-Thinking-2507 and DeepSeek-R1-0528 end their
generation prompt with `<think>\n`): the completion then begins inside it (`started`), and
everything up to `</think>` is reasoning.
"""


PROMPT_TAIL_TOKENS = 32  # the prompt's last tokens read for an opened block (its tag and newlines, any tokenizer)


def cut_tag(text: str, tag: str) -> int:
    """How many characters at the end of text may be the start of tag, cut off: the longest
    proper prefix of tag that text ends with (0: none)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)


class Qwen3ReasoningParser:
    start, end = "<think>", "</think>"

    def opened_by(self, prompt_tail: str) -> bool:
        """Whether a prompt ending with this text leaves the completion inside a reasoning block."""
        return prompt_tail.rstrip().endswith(self.start)

    def split(self, text: str, started: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished completion: one that opens with <think> (or begins
        inside the block: started) has its reasoning up to </think> (all of it, if it never closes
        the block); any other is content."""
        if started:
            text = self.start + text
        if not text.startswith(self.start):
            return None, text or None
        body = text[len(self.start):]
        if self.end not in body:
            return body.strip("\n") or None, None
        reasoning, content = body.split(self.end, 1)
        return reasoning.strip("\n") or None, content.lstrip("\n") or None


class ReasoningStream:
    """One choice's streamed text split as it comes: push() each delta and get its (reasoning,
    content) deltas; what may still turn out otherwise (a cut tag, newlines before </think>)
    waits for the next delta. The deltas add up to split() of the whole text."""

    def __init__(self, parser: Qwen3ReasoningParser, started: bool = False):
        # (a block the prompt opened reads as one the completion opened: the text starts with the tag)
        self.parser, self.text, self.sent_reasoning, self.sent_content = parser, parser.start if started else "", 0, 0

    def push(self, delta: str, finished: bool) -> tuple[str, str]:
        self.text += delta
        if finished:
            reasoning, content = (part or "" for part in self.parser.split(self.text))
        else:
            reasoning, content = self._known()
        new = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return new

    def _known(self) -> tuple[str, str]:
        """The reasoning and content that split() of any continuation of the text starts with."""
        p, text = self.parser, self.text
        if p.start.startswith(text):
            return "", ""  # (it may be opening a block)
        if not text.startswith(p.start):
            return "", text
        body = text[len(p.start):]
        if p.end in body:
            reasoning, content = body.split(p.end, 1)
            return reasoning.strip("\n"), content.lstrip("\n")
        return body[:len(body) - cut_tag(body, p.end)].strip("\n"), ""


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
