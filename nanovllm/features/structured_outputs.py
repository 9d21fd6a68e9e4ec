"""Structured outputs: a request's completion constrained to a JSON schema, a regex, a choice of
strings or an EBNF grammar (SamplingParams.structured_outputs), with xgrammar, the library vLLM
and SGLang use (the `structured` extra).

Each request's grammar is compiled once, on submission (Grammars.compile), on the process's grammar
threads (never the engine loop's, nor a server's event loop), bounded (check_size) and timed, so a
pathological schema fails alone, with a ValueError; compiled grammars stay in an LRU cache. A JSON
schema is checked first (json_schema.check_schema) and generated compact (xgrammar's any_whitespace
off): with free whitespace a model can pad forever, the failure vLLM's --disable-any-whitespace
exists for. Each sample has its own matcher (Sequence.matcher); each step the host fills the masks
of the rows with one (fill_bitmask), and the sampler applies them before anything else
(processed_logits), so greedy, sampling and the penalties all see the constrained distribution. A
mask waits for its row's last token (Grammars.launch), so constrained sequences decode every step
even under overlap scheduling; they never draft. StructuredOutputsParams.reasoning puts a free
reasoning block before the constrained part (reasoning_grammar), for a server's --reasoning-parser.
"""
import atexit
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_all
from queue import Empty, SimpleQueue

import numpy as np
import torch

from nanovllm.features.json_schema import UnsupportedSchema, check_schema
from nanovllm.features.structured_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0   # a grammar whose own compile takes longer fails its request (not its wait behind others)
COMPILE_THREADS = 2        # requests' grammars compiled at once (each compile also uses xgrammar's own threads)
CACHE_SIZE = 256           # compiled grammars kept, least recently used first out
POLL_S = 0.1               # how often a wait for a compile checks its time limit (and a server's shutdown)
# The work one constraint may ask of a compile, bounded before it is queued (a compile cannot be
# stopped once it runs). Measured here (2 cores): an enum of 5,000 values (79 KB) compiles in 0.3 s
# and one of 10,000 in 1.2 s (100,000 took 35 s); a 60 KB regex of alternatives 2.8 s; xgrammar's
# schema conversion grows steeply with nesting (200 JSON levels 0.15 s, 400 levels 1 s, 800 levels
# 28 s). 64 KiB holds any hand-written schema; OpenAI's structured outputs allow 10 levels of nesting.
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_JSON_NESTING = 64      # levels of arrays and objects in a JSON schema's text (a schema level is about 2)
# xgrammar (0.2.9) writes JSON strings with two character classes that let through what JSON may
# not hold: a string with minLength or maxLength gets the first below, which admits raw control
# characters (invalid JSON: strict parsers such as pydantic's refuse it), in a counted repetition or
# bare (maxLength 1); every string's class admits the UTF-16 surrogates U+D800..U+DFFF, whose 3-byte
# encodings are invalid UTF-8. They are the only negated classes xgrammar's JSON rules hold (any
# schema keyword, any place), so JSON grammars are patched by replacing them wherever they stand
# (JSON_PATCHES: old -> new text). A bounded string still takes no escapes, as xgrammar has it: an
# escape alternative in its counted repetition made filling 64 masks 10x slower (1,006 against 101
# us, maxLength 48). An unbounded string's \uXXXX escape could name a lone surrogate ("\ud800"),
# which strict parsers (pydantic's, serde_json) refuse: JSON_ESCAPE takes surrogates only in a pair,
# high then low, as UTF-16 has it.
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
        import xgrammar  # (the `structured` extra: loaded when used)
    except ImportError as e:
        raise ValueError("structured outputs need xgrammar: pip install 'nanovllm[structured]' (with the CPU build "
                         "of torch, install it in the same command as torch==...+cpu)") from e
    return xgrammar


class GrammarThreads:
    """COMPILE_THREADS daemon threads that run grammar jobs (compiles, and building a required tool
    call's grammar), first come first served, for every engine of the process. A job not started
    yet can be cancelled (its client went away); one running cannot (xgrammar cannot stop a
    compile: hence check_size). At exit the jobs not started are dropped and those running waited
    for (finish_at_exit): a thread killed in the middle of a compile would abort the process."""

    def __init__(self, num_threads: int):
        self.jobs: SimpleQueue = SimpleQueue()
        self.running: set[Future] = set()
        for i in range(num_threads):
            threading.Thread(target=self._work, name=f"nanovllm-grammar-{i}", daemon=True).start()
        atexit.register(self.finish_at_exit)

    def submit(self, work, *args) -> Future:
        """A future of work(*args); its `started` is when a thread took it up (time.monotonic())."""
        job = new_job()
        self.jobs.put((job, work, args))
        return job

    def _work(self):
        while True:
            job, work, args = self.jobs.get()
            if not job.set_running_or_notify_cancel():
                continue  # (cancelled while it waited)
            job.started = time.monotonic()
            self.running.add(job)
            try:
                job.set_result(work(*args))
            except BaseException as e:
                job.set_exception(e)
            finally:
                self.running.discard(job)

    def finish_at_exit(self):
        while True:
            try:
                job, _, _ = self.jobs.get_nowait()
            except Empty:
                break
            job.cancel()
        wait_all(list(self.running))


def new_job() -> Future:
    """A grammar job's future, not started (overdue() reads `started`)."""
    job = Future()
    job.started = None
    return job


_threads: GrammarThreads | None = None
_threads_lock = threading.Lock()


def grammar_threads() -> GrammarThreads:
    """The process's grammar threads, started on first use."""
    global _threads
    with _threads_lock:
        if _threads is None:
            _threads = GrammarThreads(COMPILE_THREADS)
        return _threads


def overdue(job: Future, timeout_s: float) -> bool:
    """Whether a grammar job has run for over timeout_s: its own run, not its wait behind others."""
    return job.started is not None and time.monotonic() - job.started > timeout_s


def check_size(params: StructuredOutputsParams):
    """A ValueError for a constraint that asks more of a compile than a request may: its text over
    MAX_CONSTRAINT_CHARS, or a JSON schema nested deeper than MAX_JSON_NESTING."""
    kind = params.kind
    if kind == "json":
        check_schema_size(params.json, f"structured_outputs.{kind}")
    elif kind != "json_object":
        check_length(sum(map(len, params.choice)) if kind == "choice" else len(getattr(params, kind)),
                     f"structured_outputs.{kind}")


def check_length(size: int, name: str):
    if size > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{name} has {size:,} characters, more than the {MAX_CONSTRAINT_CHARS:,} one request may "
                         f"compile")


def check_schema_size(schema: str | dict, name: str):
    """check_size of a JSON schema (its JSON text, or the value)."""
    text = json.dumps(schema) if not isinstance(schema, str) else schema
    check_length(len(text), name)
    depth = deepest = 0
    in_string = escaped = False
    for c in text:  # (brackets outside strings: no recursion, whatever the depth)
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    if deepest > MAX_JSON_NESTING:
        raise ValueError(f"{name} nests {deepest} levels deep, more than the {MAX_JSON_NESTING} one request may "
                         f"compile")


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
        self.timeout_s = COMPILE_TIMEOUT_S

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of a constraint (cached, else compiled on a grammar thread); a
        ValueError for one too large (check_size), that does not compile or accepts no text, or
        whose compile took over timeout_s (xgrammar cannot stop it, but nothing waits for it)."""
        job = self.submit(params)
        while True:
            try:
                return job.result(timeout=POLL_S)
            except FutureTimeout:
                if overdue(job, self.timeout_s):
                    job.cancel()
                    raise ValueError(f"structured_outputs.{params.kind}: compiling it took over {self.timeout_s:g} "
                                     "s; simplify it") from None

    def submit(self, params: StructuredOutputsParams) -> Future:
        """compile() as a future: done at once from the cache, else a job of the grammar threads."""
        check_size(params)
        with self.lock:
            if params in self.cache:
                self.cache.move_to_end(params)
                job = new_job()
                job.set_result(self.cache[params])
                return job
        return grammar_threads().submit(self._compile_and_keep, params)

    def _compile_and_keep(self, params: StructuredOutputsParams):
        compiled = self._compile(params)
        with self.lock:
            self.cache[params] = compiled
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return compiled

    def first_tokens(self, compiled) -> np.ndarray:
        """bool [V]: the tokens a completion under this grammar may begin with."""
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        self.xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")  # (bit t of word t // 32)
        return bits[:self.vocab_size].astype(bool)

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
                block = reasoning_grammar(*params.reasoning, started=params.reasoning_started)
                grammar = Grammar.concat(Grammar.from_ebnf(block), grammar)
            compiled = self.compiler.compile_grammar(grammar)
        except UnsupportedSchema as e:  # (a schema whose outputs xgrammar would let break it: not "not valid")
            raise ValueError(f"structured_outputs.{kind}: {e}") from None
        except Exception as e:  # xgrammar raises RuntimeError with the parser's message
            raise ValueError(f"structured_outputs.{kind} is not a valid {DESCRIPTIONS[kind]}: "
                             f"{xgrammar_message(e)}") from e
        if not self.first_tokens(compiled).any():  # (`root ::= root`, an empty character class, ...)
            raise ValueError(f"structured_outputs.{kind} accepts no text: no token can begin a completion under it")
        return compiled

    def compile_request(self, sampling_params):
        """compile() of a request's structured_outputs, then check_first_token. Any thread may call
        it (a server compiles first, and the engine's own call is then a cache hit)."""
        compiled = self.compile(sampling_params.structured_outputs)
        self.check_first_token(sampling_params, compiled)
        return compiled

    def check_first_token(self, sampling_params, compiled):
        """A ValueError when allowed_token_ids holds no token the request's grammar may begin with:
        its first step could sample nothing."""
        allowed = sampling_params.allowed_token_ids
        if allowed is not None and not self.first_tokens(compiled)[list(allowed)].any():
            raise ValueError("SamplingParams.allowed_token_ids holds no token that the structured_outputs constraint "
                             "lets a completion begin with")

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def launch(self, runner, batch, sampling, seqs: list, overlap: bool) -> tuple:
        """Launch a step with constrained rows (LLMEngine._launch's hook): (its SampledTokens, None),
        the masks filled first; or, when a grammar waits for the token in flight (overlap), (None,
        deferred): the forward runs now, and sample_deferred() queues the sampling once that token
        is in, as SGLang does. seqs: the step's sampling sequences (no speculation: one row each)."""
        masked = sampling.processors
        if overlap and any(seqs[i].num_tokens - len(seqs[i].token_ids) > 1 for i, _ in masked.matchers):
            return None, (runner.launch(batch, sampling, defer_sampling=True), sampling)
        masked.bitmask = self.fill_bitmask(masked.matchers)
        return runner.launch(batch, sampling), None

    def sample_deferred(self, runner, deferred: tuple):
        """Queue a deferred step's sampling, its grammars having taken the tokens before; a grammar
        that ended there (its sequence finished: this step's token is dropped) is skipped."""
        forward, sampling = deferred
        live = [(i, m) for i, m in sampling.processors.matchers if not m.is_terminated()]
        if live:
            sampling.processors.bitmask = self.fill_bitmask(live)
        with torch.inference_mode():
            return runner.sample(forward, sampling)

    def fill_bitmask(self, matchers: list[tuple[int, object]]) -> tuple[np.ndarray, torch.Tensor]:
        """(sampling row, matcher) pairs -> (rows [n] int64, bitmask [n, ceil(V / 32)] int32): bit t
        of row i set where the grammar lets token t follow."""
        bitmask = self.xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, (_, matcher) in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        return np.array([row for row, _ in matchers], dtype=np.int64), bitmask


class _Refused:
    """A grammar matcher's stand-in once its grammar refused a token: ends the sequence."""
    @staticmethod
    def is_terminated() -> bool:
        return True


REFUSED = _Refused()


def advance_grammars(seqs: list, tokens: list[int]):
    """Feed each constrained sequence's new token to its grammar (Scheduler.complete's hook: it ends
    one whose grammar is complete and took its stop token). A token the grammar refuses was drawn
    from a row with no token left (its mask and allowed_token_ids have none in common): that
    sequence alone ends, with finish_reason "error" (its matcher is REFUSED)."""
    for seq, token in zip(seqs, tokens):
        if seq.matcher is not None and not seq.matcher.accept_token(token):
            logger.warning("sequence %s: no token meets its constraints (its grammar refused token %d); ending it "
                           "with finish_reason 'error'", seq.seq_id, token)
            seq.matcher = REFUSED


def xgrammar_message(error: Exception) -> str:
    """What an xgrammar error says, without the time and C++ source line it starts with
    ("[01:11:01] /project/cpp/regex_converter.cc:94: Regex parsing error ...")."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return XGRAMMAR_PREFIX.sub("", lines[-1])


XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


def json_grammar(schema: str | dict, root: str = "root") -> str:
    """The EBNF text (xgrammar's) of compact JSON valid against schema (else UnsupportedSchema:
    check_schema), with JSON_PATCHES applied, its top rule named root (another lets a grammar embed it)."""
    grammar = str(import_xgrammar().Grammar.from_json_schema(json.dumps(check_schema(schema)), any_whitespace=False))
    for old, new in JSON_PATCHES:
        grammar = grammar.replace(old, new)
    return grammar if root == "root" else re.sub(r"\broot\b", root, grammar)


def reasoning_grammar(start: str, end: str, started: bool = False) -> str:
    """EBNF of an optional reasoning block: start, any text that does not hold end, end, then
    spaces or newlines; once started (the prompt holds the start tag), the rest of the block,
    not optional. "Text without end" is the automaton of the search for end (KMP): state
    s_k has matched end's first k characters; a character of end moves to the longest prefix of
    end that the text so far ends with, any other back to s_0, and none may complete end."""
    def literal(c):
        return json.dumps(c)

    def char_class(chars):
        return "".join("\\" + c if c in "\\]^-" else c for c in sorted(chars))

    def next_state(k: int, c: str) -> int:
        text = end[:k] + c
        return next(n for n in range(min(len(text), len(end)), -1, -1) if text.endswith(end[:n]))
    block = f"s0 {literal(end)} [ \\n]*"
    rules = [f"root ::= {block}" if started else f"root ::= ({literal(start)} {block})?"]
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
