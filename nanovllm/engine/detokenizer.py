"""Completion text, token by token."""

# Prompt tokens decoded along with the completion: tokenizers that merge or strip spaces (a
# SentencePiece "▁", a byte-level "Ġ") render a token's text from its neighbours.
CONTEXT_TOKENS = 5
INCOMPLETE = "\ufffd"  # what decode() shows for a UTF-8 character cut in the middle


def completion_text(tokenizer, prompt_ids: list[int], completion_ids: list[int]) -> str:
    """The completion's text, decoded in the context of the prompt's last tokens, in one go;
    `IncrementalDetokenizer`'s pieces concatenate to the same text."""
    context = prompt_ids[-CONTEXT_TOKENS:]
    prefix = tokenizer.decode(context, skip_special_tokens=True)
    return tokenizer.decode(context + completion_ids, skip_special_tokens=True)[len(prefix):]


class IncrementalDetokenizer:
    """Each `update` returns the text that its new tokens add. Decoding a small window (from the
    last emitted boundary, with the token before it as context) keeps each step O(1), and text is
    held back while it ends inside a multi-byte character."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0              # start of the decoded window
        self.read_offset = len(self.ids)    # tokens before this are already emitted
        self.num_completion_ids = 0         # completion tokens given to update() so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        self.num_completion_ids += len(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith(INCOMPLETE) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]
