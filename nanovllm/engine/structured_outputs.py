"""Structured outputs: a request's completion constrained to a JSON schema, a regex, a choice of
strings or an EBNF grammar (SamplingParams.structured_outputs), with xgrammar, the library vLLM
and SGLang use (the `structured` extra).

The engine compiles each request's grammar once, when it is submitted (Grammars.compile, in the
caller's thread, or a server's worker thread: never on the engine loop), with a time limit: a
pathological schema fails alone, with a ValueError, instead of stalling the others. xgrammar's
compiled grammars stay in an LRU cache keyed by the constraint, so the same schema compiles once
however many requests bring it. A JSON schema is checked first (json_schema.check_schema): a
keyword xgrammar would not enforce, or one no value satisfies, is a ValueError naming it and where
it stands, so that every output validates. Every sample of the request gets its
own matcher (Sequence.matcher), which follows the tokens it accepts. JSON is generated compact
(xgrammar's any_whitespace off: one space after ':' and ',' at most): with free whitespace
a model can pad forever, the failure vLLM's --disable-any-whitespace exists for.

Each step, for the sampling rows with a matcher only (Need.GRAMMAR), the host fills a bitmask of
the tokens the grammar allows next (fill_bitmask); the sampler sets the others' logits to -inf
before anything else (processed_logits), so greedy, sampling and the penalties all see the
constrained distribution. Rows without a constraint pay nothing. The scheduler feeds each
sampled token to its matcher and ends the sequence once the grammar is complete and has taken
its stop token. A constrained row's mask depends on its last token: under overlap scheduling,
a step planned while that token is in flight launches its forward at once but queues its
sampling only after the step before is accounted for (LLMEngine._sample_deferred, as SGLang
does), so constrained sequences decode every step; a constrained sequence never drafts. StructuredOutputsParams.reasoning puts a free reasoning
block before the constrained part (reasoning_grammar), for a server's --reasoning-parser.
"""
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import torch

from nanovllm.engine.json_schema import UnsupportedSchema, check_schema
from nanovllm.sampling_params import StructuredOutputsParams

COMPILE_TIMEOUT_S = 10.0   # a grammar that takes longer to compile fails its request
COMPILE_THREADS = 2        # requests' grammars compiled at once (each compile also uses xgrammar's own threads)
CACHE_SIZE = 256           # compiled grammars kept, least recently used first out
# xgrammar (0.2.9) writes JSON strings with two character classes that let through what JSON text
# may not hold: a string with minLength or maxLength gets the first class below, which admits raw
# control characters (invalid JSON: strict parsers such as pydantic's refuse it), inside a counted
# repetition, or bare where at most one character is allowed (maxLength 1); every string's class
# admits the UTF-16 surrogates U+D800..U+DFFF, whose 3-byte encodings are invalid UTF-8 (they
# decode to U+FFFD). Those two are the only negated classes xgrammar's JSON rules hold (any schema
# keyword, any place), so JSON grammars are patched by replacing them wherever they stand
# (JSON_PATCHES: old -> new text). A bounded string still takes no escapes, as xgrammar has it: an
# escape alternative inside its counted repetition made filling 64 masks 10x slower (1,006 against
# 101 us, maxLength 48). An unbounded string's \uXXXX escape may name a lone surrogate ("\ud800"),
# which strict parsers (pydantic's, serde_json) refuse: an escaped surrogate comes in a pair, high
# then low, as UTF-16 has it (JSON_ESCAPE).
JSON_CHARACTER = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'
HEX = "[A-Fa-f0-9]"
JSON_ESCAPE = (f'("u" ([A-Ca-cE-Fe-f0-9] {HEX} {HEX} {HEX} | [Dd] [0-7] {HEX} {HEX}'
               f' | [Dd] [89ABab] {HEX} {HEX} "\\\\u" [Dd] [C-Fc-f] {HEX} {HEX}))')
JSON_PATCHES = (
    (r'[^\"\\\r\n]', JSON_CHARACTER),
    (r'[^\0-\x1f\"\\\r\n]', JSON_CHARACTER),
    (f'("u" {HEX} {HEX} {HEX} {HEX})', JSON_ESCAPE),
)


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured outputs need xgrammar: pip install 'nanovllm[structured]' (with the CPU build "
                         "of torch, install it in the same command as torch==...+cpu)") from e
    return xgrammar


class Grammars:
    """The engine's grammar compiler and its cache, for one tokenizer and vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        xgr = import_xgrammar()
        self.xgr, self.vocab_size = xgr, vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        self.cache: OrderedDict[StructuredOutputsParams, object] = OrderedDict()  # LRU, CACHE_SIZE at most
        self.lock = threading.Lock()  # (requests compile from several threads)
        self.pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="nanovllm-grammar")
        self.timeout_s = COMPILE_TIMEOUT_S

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of a constraint (xgrammar's CompiledGrammar, from the LRU cache when
        it was compiled before): a ValueError names a constraint that does not compile, or that
        took over timeout_s (its compile goes on in the background: xgrammar cannot stop it, but
        nothing waits for it)."""
        with self.lock:
            if params in self.cache:
                self.cache.move_to_end(params)
                return self.cache[params]
        future = self.pool.submit(self._compile, params)
        try:
            compiled = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise ValueError(f"structured_outputs.{params.kind}: compiling it took over {self.timeout_s:g} s; "
                             "simplify it") from None
        with self.lock:
            self.cache[params] = compiled
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams):
        kind, Grammar = params.kind, self.xgr.Grammar
        try:
            if kind in ("json", "json_object"):
                grammar = Grammar.from_ebnf(json_grammar(params.json or '{"type": "object"}'))
            elif kind == "regex":
                grammar = Grammar.from_regex(params.regex)
            elif kind == "choice":  # one string literal per choice (JSON escapes are GBNF's)
                grammar = Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(choice) for choice in params.choice))
            else:
                grammar = Grammar.from_ebnf(params.grammar)
            if params.reasoning is not None:  # a free reasoning block first, then the constraint
                grammar = Grammar.concat(Grammar.from_ebnf(reasoning_grammar(*params.reasoning)), grammar)
            return self.compiler.compile_grammar(grammar)
        except UnsupportedSchema as e:  # (a schema whose outputs xgrammar would let break it: not "not valid")
            raise ValueError(f"structured_outputs.{kind}: {e}") from None
        except Exception as e:  # xgrammar raises RuntimeError with the parser's message
            raise ValueError(f"structured_outputs.{kind} is not a valid {DESCRIPTIONS[kind]}: "
                             f"{str(e).strip().splitlines()[-1]}") from e

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: list[tuple[int, object]]) -> tuple[np.ndarray, torch.Tensor]:
        """(sampling row, matcher) pairs -> (rows [n] int64, bitmask [n, ceil(V / 32)] int32): bit t
        of row i set where the grammar lets token t follow."""
        bitmask = self.xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, (_, matcher) in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        return np.array([row for row, _ in matchers], dtype=np.int64), bitmask


def json_grammar(schema: str | dict, root: str = "root") -> str:
    """The EBNF text (xgrammar's) of compact JSON valid against schema, its top rule named root
    (another name lets a grammar embed it), with JSON_PATCHES applied. UnsupportedSchema (a
    ValueError) names a keyword xgrammar would not enforce (json_schema.check_schema)."""
    grammar = str(import_xgrammar().Grammar.from_json_schema(json.dumps(check_schema(schema)), any_whitespace=False))
    for old, new in JSON_PATCHES:
        grammar = grammar.replace(old, new)
    return grammar if root == "root" else re.sub(r"\broot\b", root, grammar)


def reasoning_grammar(start: str, end: str) -> str:
    """EBNF of an optional reasoning block: start, any text that does not hold end, end, then
    spaces or newlines. "Text without end" is the automaton of the search for end (KMP): state
    s_k has matched end's first k characters; a character of end moves to the longest prefix of
    end that the text so far ends with, any other back to s_0, and none may complete end."""
    def literal(c):
        return json.dumps(c)

    def char_class(chars):
        return "".join("\\" + c if c in "\\]^-" else c for c in sorted(chars))

    def next_state(k: int, c: str) -> int:
        text = end[:k] + c
        return next(n for n in range(min(len(text), len(end)), -1, -1) if text.endswith(end[:n]))
    rules = [f"root ::= ({literal(start)} s0 {literal(end)} [ \\n]*)?"]
    for k in range(len(end)):
        alternatives = ['""', f"[^{char_class(set(end))}] s0"]
        for c in sorted(set(end)):
            n = next_state(k, c)
            if n < len(end):
                alternatives.append(f"{literal(c)} s{n}")
        rules.append(f"s{k} ::= " + " | ".join(alternatives))
    return "\n".join(rules)


DESCRIPTIONS = {"json": "JSON schema", "regex": "regular expression", "choice": "list of choices",
                "grammar": "EBNF grammar", "json_object": "JSON object"}


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, V] with the tokens each of these rows' grammars forbid at -inf (a copy: the raw
    logits, which logprobs read, stay as they are)."""
    xgr = import_xgrammar()
    constrained = logits[rows]
    xgr.apply_token_bitmask_inplace(constrained, bitmask.to(logits.device, non_blocking=True))
    logits = logits.clone()
    logits[rows] = constrained
    return logits
