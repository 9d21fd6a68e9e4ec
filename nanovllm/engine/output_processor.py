"""Output processing: what a request's caller gets from its sequences. Text detokenized token by
token where wanted (a stream, stop strings to find), stop strings ending a sequence, a sample's
final text, a request's output (its n samples fanned back in), and a stream's updates."""
from nanovllm.engine.sequence import Sequence

# Prompt tokens decoded along with the completion: tokenizers that merge or strip spaces (a
# SentencePiece "▁", a byte-level "Ġ") render a token's text from its neighbours.
CONTEXT_TOKENS = 5
INCOMPLETE = "\ufffd"  # what decode() shows for a UTF-8 character cut in the middle


def completion_text(tokenizer, prompt_ids: list[int], completion_ids: list[int], skip_special_tokens: bool) -> str:
    """The completion's text, decoded in the context of the prompt's last tokens, in one go;
    `IncrementalDetokenizer`'s pieces concatenate to the same text."""
    context = prompt_ids[-CONTEXT_TOKENS:]
    prefix = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(context + completion_ids, skip_special_tokens=skip_special_tokens)[len(prefix):]


class IncrementalDetokenizer:
    """Each `update` returns the text that its new tokens add. Decoding a small window (from the
    last emitted boundary, with the token before it as context) keeps each step O(1), and text is
    held back while it ends inside a multi-byte character."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0              # start of the decoded window
        self.read_offset = len(self.ids)    # tokens before this are already emitted
        self.num_completion_ids = 0         # completion tokens given to update() so far

    def update(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        self.num_completion_ids += len(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith(INCOMPLETE) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]


class OutputProcessor:
    def __init__(self, tokenizer, finish):
        self.tokenizer = tokenizer
        self.finish = finish  # Scheduler.finish: a stop string ends a sequence wherever it is

    def watch(self, samples: list[Sequence], stream: bool):
        """Detokenize these new samples token by token when their text is wanted as it grows."""
        if self.tokenizer is not None and (stream or samples[0].sampling_params.stop_strings):
            skip = samples[0].sampling_params.skip_special_tokens  # (a request's samples share their params)
            for seq in samples:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids[:seq.num_prompt_tokens], skip)

    def update_text(self, seq: Sequence):
        """Grow seq.text by its new tokens, one at a time (a speculative step brings several); end the
        sequence at a stop string, dropping the tokens after it (plain decoding would not make them)."""
        new_ids = seq.token_ids[seq.num_prompt_tokens + seq.detokenizer.num_completion_ids:]
        ended_by_token = seq.stop_reason is not None  # (its last token: then a stop string there does not count)
        for i, token in enumerate(new_ids):
            later = len(new_ids) - 1 - i  # the tokens after this one
            seen = len(seq.text)
            seq.text += seq.detokenizer.update([token], final=seq.is_finished and not later)
            if (later or not ended_by_token) and self._ends_at_stop_string(seq, seen, later):
                if later:
                    seq.truncate(later)
                return

    def _ends_at_stop_string(self, seq: Sequence, seen: int, later: int) -> bool:
        """Whether the text, grown from `seen` characters, now holds a stop string (and min_tokens
        tokens, `later` of them not counted yet); if so, cut it there and finish the sequence."""
        params = seq.sampling_params
        if not params.stop_strings or seq.num_completion_tokens - later < params.min_tokens:
            return False
        start = max(0, seen - max(map(len, params.stop_strings)) + 1)  # a match may begin in older text
        hits = [(i, stop) for stop in params.stop_strings if (i := seq.text.find(stop, start)) >= 0]
        if not hits:
            return False
        i, stop = min(hits)
        seq.text = seq.text[:i + len(stop) if params.include_stop_str_in_output else i]
        if seq.is_finished:  # (a speculative step's run ended it, by length: the stop string counts)
            seq.finish("stop", stop, seq.finish_time)
        else:
            self.finish(seq, "stop", stop)
        return True

    def final_text(self, seq: Sequence) -> str | None:
        """Its whole completion text (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        if isinstance(seq.stop_reason, str):  # cut at a stop string
            return seq.text
        ids, params = seq.completion_token_ids, seq.sampling_params
        if isinstance(seq.stop_reason, int) and not params.include_stop_str_in_output:
            ids = ids[:-1]  # the stop token's own text is left out, as a stop string's is
        return completion_text(self.tokenizer, seq.token_ids[:seq.num_prompt_tokens], ids, params.skip_special_tokens)

    def sample_output(self, seq: Sequence) -> dict:
        out = {"text": self.final_text(seq), "token_ids": seq.completion_token_ids,
               "num_cached_tokens": seq.num_cached_tokens, "finish_reason": seq.finish_reason,
               "stop_reason": seq.stop_reason, "metrics": seq.metrics()}
        if seq.logprobs is not None:
            out["logprobs"] = seq.logprobs
        if seq.prompt_logprobs is not None:
            out["prompt_logprobs"] = seq.prompt_logprobs
        return out

    def output(self, samples: list[Sequence]) -> dict:
        """A request's output: the first sample's fields, and with n > 1 all of them in `samples`."""
        outs = [self.sample_output(seq) for seq in samples]
        return {**outs[0], "samples": outs} if len(outs) > 1 else outs[0]

    def stream_update(self, seq: Sequence) -> dict | None:
        """What is new in seq since its last update (None: nothing), as stream()'s dict, each token and
        character reported once. A sequence without a detokenizer has text only in its last update."""
        first = seq.num_emitted_tokens
        if seq.is_finished:
            text = self.final_text(seq)
        elif seq.detokenizer is not None:
            # hold back what could still turn out to be the start of a stop string
            held = max(map(len, seq.sampling_params.stop_strings), default=1) - 1
            text = seq.text[:max(len(seq.text) - held, seq.num_emitted_chars)]
        else:
            text = None
        new_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted_tokens:]
        new_text = text[seq.num_emitted_chars:] if text is not None else None
        if not new_ids and not new_text and not seq.is_finished:
            return None
        seq.num_emitted_tokens += len(new_ids)
        seq.num_emitted_chars += len(new_text or "")
        update = {"index": seq.index, "sample": seq.sample_index, "text": new_text, "token_ids": new_ids,
                  "finished": seq.is_finished}
        if seq.logprobs is not None:
            update["logprobs"] = seq.logprobs[first:first + len(new_ids)]
        if first == 0 and seq.prompt_logprobs is not None:  # (complete once the first token is in)
            update["prompt_logprobs"] = seq.prompt_logprobs
        if seq.is_finished:
            update.update(finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                          num_cached_tokens=seq.num_cached_tokens, metrics=seq.metrics())
        return update
