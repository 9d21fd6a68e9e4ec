"""Structured outputs (SamplingParams.structured_outputs, features/structured_outputs.py): a
random-weight model constrained by a JSON schema, a regex, a choice or a grammar emits text that
satisfies it, for many random schemas (nested objects, bounded arrays, enums, anyOf), sampled and
greedy, alone and mixed in one batch with unconstrained requests, whose outputs do not change;
with chunked prefill, preemption, n > 1, overlap scheduling and speculative decoding; bad
constraints are ValueErrors naming them, and a grammar that compiles too long fails alone."""
import json
import re
import threading

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the 'structured' extra)")
jsonschema = pytest.importorskip("jsonschema")

from nanovllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

MAX_LEN = 512
PROMPT = [5, 17, 33, 2, 9]


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir, max_model_len=MAX_LEN) as llm:
        yield llm


def constrained(kind, value, **params) -> SamplingParams:
    return SamplingParams(max_tokens=params.pop("max_tokens", 300), **params,
                          structured_outputs=StructuredOutputsParams(**{kind: value}))


# Schemas whose every instance is short (bounded strings, arrays and integers), so that a random
# model's output ends well within max_tokens.
leaves = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 1000)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["red", "green", "blue", "a b", 'q"uote']), min_size=1, max_size=4, unique=True)
      .map(lambda values: {"enum": values}),
)


def containers(children):
    names = st.sampled_from(["id", "name", "tags", "x", "nested", "value"])
    objects = st.dictionaries(names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}))
    arrays = st.builds(lambda items, lo, extra: {"type": "array", "items": items, "minItems": lo,
                                                 "maxItems": lo + extra},
                       children, st.integers(0, 2), st.integers(0, 2))
    any_of = st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options})
    return st.one_of(objects, arrays, any_of)


schemas = st.recursive(leaves, containers, max_leaves=6)


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas, temperature=st.sampled_from([0.0, 0.8, 1.5]), seed=st.integers(0, 2**32))
def test_output_satisfies_random_json_schemas(llm, schema, temperature, seed):
    out = llm.generate([PROMPT], constrained("json", schema, temperature=temperature, seed=seed), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop", (schema, out["text"])
    jsonschema.validate(parse(out["text"]), schema)


# Schemas over every keyword of JSON Schema 2020-12's validation and applicator vocabularies, nested,
# each also where xgrammar does not enforce it (beside $ref, untyped, ...), with $ref into $defs
# and definitions, boolean schemas and formats; instances short enough that most outputs end
# within MAX_TOKENS. Each is refused by name or yields outputs valid against it.
NAMES = ["a", "b", "c"]
PATTERNS = ["^[a-c]{1,3}$", "x", "^.{0,2}$", "^[^ab]{1,2}$", "^\\d{1,3}$", "^(?:ab|c)-?$", '^"$', "^\\\\$",
            "^\\W$", "(?=a)a", "a$b", "^[ -~]{1,2}$", "^\\n$"]
maybe = st.booleans()


def keywords(**strategies):
    """A dict of some of these keywords (each there half the time)."""
    return st.fixed_dictionaries({}, optional=strategies)


def rarely(**strategies):
    """A dict of some of these keywords, most often none (xgrammar ignores them: refused)."""
    return st.one_of(st.just({}), keywords(**strategies))


all_keyword_leaves = st.one_of(
    keywords(minimum=st.integers(-5, 5), maximum=st.integers(-5, 30), exclusiveMinimum=st.integers(-6, 5),
             exclusiveMaximum=st.integers(-5, 31), multipleOf=st.sampled_from([1, 2, 3, 1.5])).map(
        lambda k: {"type": "integer", **k}),
    keywords(minimum=st.sampled_from([-2.5, 0, 1]), maximum=st.sampled_from([1.5, 3, 100]),
             exclusiveMaximum=st.sampled_from([2, 7.25]), multipleOf=st.sampled_from([0.5, 2])).map(
        lambda k: {"type": "number", **k}),
    st.builds(lambda most, k: {"type": "string", "maxLength": most, **k}, st.integers(0, 4),
              keywords(minLength=st.integers(0, 3), format=st.just("bogus"))),
    st.builds(lambda pattern, k: {"type": "string", "pattern": pattern, **k}, st.sampled_from(PATTERNS),
              rarely(maxLength=st.integers(1, 3))),
    st.builds(lambda form, k: {"type": "string", "format": form, **k},
              st.sampled_from(["date", "uuid", "ipv4", "time"]),
              rarely(minLength=st.integers(1, 3), pattern=st.just("^1"))),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, True, {}]),
    st.builds(lambda values, typed: {"enum": values, **({"type": typed} if typed else {})},
              st.lists(st.sampled_from([1, 2.5, "a", "b", True, None, [1], {"k": 1}]), min_size=1, max_size=4,
                       unique_by=repr),
              st.sampled_from([None, "string", "integer"])),
    st.sampled_from([1, "a", None, {"k": [1, 2]}]).map(lambda value: {"const": value}),
    st.sampled_from([{"$ref": "#/$defs/word"}, {"$ref": "#/definitions/count"}, {"$ref": "#/$defs/pair"}]),
    st.sampled_from([{"maxLength": 2}, {"maximum": 3}, {"minItems": 1}, {"required": ["a"]}]),  # (untyped)
)


def all_keyword_containers(children):
    objects = st.dictionaries(st.sampled_from(NAMES), children, max_size=3).flatmap(lambda props: st.builds(
        lambda required, k, rare: {"type": "object", "properties": props, "required": required, **k, **rare},
        st.sampled_from([sorted(props), sorted(props)[:1], [], ["z"]]),
        keywords(additionalProperties=st.one_of(st.booleans(), children), minProperties=st.integers(0, 2),
                 maxProperties=st.integers(1, 3), patternProperties=st.dictionaries(
                     st.sampled_from(["^p$", "^q[0-9]$", "^a"]), children, min_size=1, max_size=2),
                 propertyNames=st.sampled_from([{"maxLength": 1}, {"pattern": "^[pqr]$"}, {"enum": ["p", "a"]}]),
                 unevaluatedProperties=st.one_of(st.booleans(), children)),
        rarely(dependentRequired=st.just({"a": ["b"]}), dependentSchemas=st.builds(lambda s: {"a": s}, children))))
    arrays = st.builds(
        lambda items, most, k, rare: {"type": "array", **({"items": items} if items is not None else {}),
                                      "maxItems": most, **k, **rare},
        st.one_of(children, st.just(False), st.none()), st.integers(0, 3),
        keywords(prefixItems=st.lists(children, min_size=1, max_size=2), minItems=st.integers(0, 2), uniqueItems=maybe,
                 unevaluatedItems=st.one_of(st.booleans(), children)),
        rarely(contains=children, minContains=st.integers(0, 2), maxContains=st.integers(1, 2)))
    applicators = st.one_of(
        st.lists(children, min_size=1, max_size=3).map(lambda branches: {"anyOf": branches}),
        st.lists(children, min_size=1, max_size=3).map(lambda branches: {"oneOf": branches}),
        st.lists(children, min_size=1, max_size=2).map(lambda branches: {"allOf": branches}),
        st.builds(lambda base, k: {**base, **k} if isinstance(base, dict) else base, children,
                  keywords(**{"not": children, "if": children, "then": children, "else": children})))
    return st.one_of(objects, arrays, applicators)


DEFS = {"word": {"type": "string", "maxLength": 3}, "pair": {"type": "array", "items": {"$ref": "#/definitions/count"},
                                                            "minItems": 2, "maxItems": 2}}
DEFINITIONS = {"count": {"type": "integer", "minimum": 0, "maximum": 9}}
all_keyword_schemas = st.recursive(all_keyword_leaves, all_keyword_containers, max_leaves=5).map(
    lambda s: {**s, "$defs": DEFS, "definitions": DEFINITIONS} if isinstance(s, dict) and not s.get("$defs") else s)
MAX_TOKENS = 80
VALIDATION = ["type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
              "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains",
              "maxProperties", "minProperties", "required", "dependentRequired"]
APPLICATORS = ["allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "prefixItems", "items",
               "contains", "properties", "patternProperties", "additionalProperties", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties"]


def refused_by_name(schema, message: str) -> bool:
    """Whether message names a keyword of the vocabularies that schema holds where it says."""
    from nanovllm.features.json_schema import DISPATCHERS, KEYWORDS
    if schema is False:
        return "the schema is false" in message
    found = re.search(r"the keyword '([^']+)' \(at ([^)]*)\)", message)
    if not found or not (found[1] in KEYWORDS or found[1] in DISPATCHERS):
        return False
    node = schema
    for part in found[2].split("/")[1:] if found[2] != "the root" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return isinstance(node, dict) and found[1] in node


def test_every_keyword_is_enforced_or_refused_by_name(llm):
    """For every schema, compiling it is a ValueError naming a keyword the schema holds (and where),
    or xgrammar's own refusal of it (rare), or every output sampled under it (two seeds) parses
    strictly and validates; outputs cut by max_tokens are not judged, but most end."""
    tally = {"schemas": 0, "refused by xgrammar": 0, "outputs": 0, "ended": 0}

    @settings(max_examples=12, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow])
    @given(batch=st.lists(all_keyword_schemas, min_size=8, max_size=8))
    def run(batch):
        params = []
        for schema in batch:
            tally["schemas"] += 1
            try:
                llm.grammar_compiler().compile_request(constrained("json", schema))
            except ValueError as e:
                if "is not a valid JSON schema" in str(e):  # (xgrammar's, e.g. minimum above maximum)
                    tally["refused by xgrammar"] += 1
                else:
                    assert refused_by_name(schema, str(e)), (schema, str(e))
                continue
            params += [(schema, constrained("json", schema, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS))
                       for seed in range(2)]
        outs = llm.generate([PROMPT] * len(params), [p for _, p in params], use_tqdm=False) if params else []
        for (schema, _), out in zip(params, outs):
            if out["finish_reason"] == "stop":
                assert jsonschema.Draft202012Validator(schema).is_valid(parse(out["text"])), (schema, out["text"])
        tally["outputs"] += len(outs)
        tally["ended"] += sum(out["finish_reason"] == "stop" for out in outs)
    run()
    assert tally["refused by xgrammar"] <= tally["schemas"] // 4 and tally["outputs"] >= tally["schemas"] // 2, tally
    assert tally["ended"] >= 0.75 * tally["outputs"], tally


def test_the_schemas_hold_every_keyword():
    """The schemas of the test above hold every keyword of the validation and applicator
    vocabularies, $ref, $defs and definitions, and format (a sample of 200 of them)."""
    vocabulary = set(VALIDATION + APPLICATORS) | {"$ref", "$defs", "definitions", "format"}
    seen = set()

    @settings(max_examples=200, deadline=None, derandomize=True, database=None, phases=[Phase.generate])
    @given(all_keyword_schemas)
    def draw(schema):
        stack = [schema]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                seen.update(k for k in node if not k.startswith("^") and k not in NAMES)
                stack += node.values()
            elif isinstance(node, list):
                stack += node
    draw()
    assert vocabulary <= seen, vocabulary - seen


def parse(text: str):
    """Strict JSON (raw control characters in strings refused, as pydantic refuses them)."""
    return json.loads(text)


def test_length_bounded_strings_are_json_strings(llm):
    """xgrammar's rule for a string with maxLength admits raw control characters (invalid JSON),
    and every string's UTF-16 surrogates (invalid UTF-8); the engine patches both: many sampled
    bounded strings all parse strictly, their lengths within the bound."""
    schema = {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 1}
    outs = llm.generate([PROMPT] * 40, [constrained("json", schema, temperature=1.0, seed=i) for i in range(40)],
                        use_tqdm=False)
    for out in outs:
        assert out["finish_reason"] == "stop"
        (value,) = parse(out["text"])
        assert len(value) <= 4


def accepts(llm, schema, text: bytes) -> bool:
    """Whether the compiled grammar of schema takes text (UTF-8, possibly invalid) as a whole output."""
    import xgrammar as xgr
    matcher = xgr.GrammarMatcher(llm.grammar_compiler().compile_request(constrained("json", schema)))
    return matcher.accept_string(text) and matcher.accept_token(min(llm.eos_token_ids))


SURROGATE = "\ud800".encode("utf-8", "surrogatepass")  # (its 3 bytes are invalid UTF-8)


@pytest.mark.parametrize("bounds", [{}, {"maxLength": 0}, {"maxLength": 1}, {"minLength": 0, "maxLength": 1},
                                    {"minLength": 1, "maxLength": 1}, {"minLength": 1}, {"maxLength": 2},
                                    {"minLength": 2, "maxLength": 2}, {"minLength": 1, "maxLength": 5}],
                         ids=lambda bounds: ",".join(f"{k}={v}" for k, v in bounds.items()) or "unbounded")
@pytest.mark.parametrize("where", ["value", "item", "prefix item", "additional value", "pattern value", "name"])
def test_strings_of_every_length_bound_hold_no_raw_control_character_or_surrogate(llm, bounds, where):
    """xgrammar writes a bounded string's characters as a class that admits raw control characters
    and surrogates, inside a repetition or, for maxLength 1, bare; both forms are patched, for
    strings as property values, items, additional and pattern properties, and property names."""
    string = {"type": "string", **bounds}
    schema, wrap = {
        "value": ({"type": "object", "properties": {"s": string}, "required": ["s"]}, b'{"s": %s}'),
        "item": ({"type": "array", "items": string, "minItems": 1, "maxItems": 1}, b"[%s]"),
        "prefix item": ({"type": "array", "prefixItems": [string], "items": False}, b"[%s]"),
        "additional value": ({"type": "object", "additionalProperties": string, "minProperties": 1}, b'{"k": %s}'),
        "pattern value": ({"type": "object", "patternProperties": {"^k$": string}, "minProperties": 1},
                          b'{"k": %s}'),
        "name": ({"type": "object", "propertyNames": string, "additionalProperties": {"type": "null"},
                  "minProperties": 1}, b"{%s: null}"),
    }[where]
    length = max(bounds.get("minLength", 1), 1)
    if bounds.get("maxLength") == 0:
        assert accepts(llm, schema, wrap % b'""') and not accepts(llm, schema, wrap % b'"a"')
        return
    assert accepts(llm, schema, wrap % (b'"' + b"a" * length + b'"'))
    for bad in (b"\x18", b"\x00", b"\x1f", SURROGATE):
        assert not accepts(llm, schema, wrap % (b'"' + bad * length + b'"')), (bad, schema)


def test_string_escapes_name_no_lone_surrogate(llm):
    """An unbounded string takes \\uXXXX escapes; xgrammar's let a lone surrogate through
    ("\\ud800", which pydantic's parser refuses): a surrogate escape comes in a high-low pair."""
    schema = {"type": "object", "additionalProperties": {"type": "string"}, "maxProperties": 1}
    for text in ['{"k": "\\ud83d\\ude00"}', '{"k": "\\u00e9\\uD7FF\\uE000\\uffff"}', '{"\\uD83D\\uDE00": "x"}']:
        assert accepts(llm, schema, text.encode()), text
    for text in ['{"k": "\\ud800"}', '{"k": "\\uDC00"}', '{"k": "\\ud800\\u0041"}', '{"k": "\\udc00\\ud800"}',
                 '{"\\ud800": "x"}']:
        assert not accepts(llm, schema, text.encode()), text


@pytest.mark.parametrize("pattern", [r"\d{3}-[a-z]{2,5}", r"(yes|no)!?", r"[A-Z][a-z]* [0-9]+\.[0-9]{2}",
                                     r"\w{1,6}@example\.(com|org)"])
def test_output_matches_regexes(llm, pattern):
    outs = llm.generate([PROMPT] * 8, [constrained("regex", pattern, temperature=1.0, seed=i, max_tokens=40)
                                       for i in range(8)], use_tqdm=False)
    for out in outs:
        if out["finish_reason"] == "stop":
            assert re.fullmatch(pattern, out["text"]), out["text"]
        else:  # (an unbounded pattern may run to max_tokens: still a prefix of a match)
            assert out["finish_reason"] == "length"
    assert sum(o["finish_reason"] == "stop" for o in outs) >= 4


def test_output_is_one_of_the_choices(llm):
    choices = ["yes", "no", "maybe so", 'say "hi"', "日本"]
    outs = llm.generate([PROMPT] * 20, [constrained("choice", choices, temperature=1.5, seed=i) for i in range(20)],
                        use_tqdm=False)
    assert all(o["text"] in choices and o["finish_reason"] == "stop" for o in outs)
    assert len({o["text"] for o in outs}) >= 2  # (sampled among them, not stuck on one)


def test_ebnf_grammar_and_json_object(llm):
    grammar = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'
    outs = llm.generate([PROMPT] * 6, [constrained("grammar", grammar, temperature=1.0, seed=i, max_tokens=60)
                                       for i in range(3)]
                        + [constrained("json_object", True, temperature=1.0, seed=i, max_tokens=400)
                           for i in range(3)], use_tqdm=False)
    for out in outs[:3]:
        assert out["finish_reason"] != "stop" or re.fullmatch(r"\((\d|[1-9]\d)(,(\d|[1-9]\d))*\)", out["text"])
    for out in outs[3:]:
        if out["finish_reason"] == "stop":
            assert isinstance(parse(out["text"]), dict)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "minItems": 1, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 32}, {"num_kvcache_blocks": 40, "max_num_seqs": 12},
                                     {"async_scheduling": False},
                                     {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}],
                         ids=["plain", "chunked-prefill", "preemption", "synchronous", "speculative"])
def test_mixed_batches_keep_the_unconstrained_outputs(model_dir, options):
    """Constrained and unconstrained requests in one batch (n = 2 for some): every constrained
    output validates, and every unconstrained one equals its output in a run without the
    constrained ones (greedy), whatever the engine's options."""
    free = [[i + 1, 2 * i + 3, 7] * (i + 1) for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with LLM(model_dir, max_model_len=MAX_LEN, **options) as llm:
        alone = llm.generate(free, greedy, use_tqdm=False)
        prompts = [p for pair in zip(free, [PROMPT] * 6) for p in pair]
        params = [p for i in range(6) for p in (greedy, constrained("json", SCHEMA, temperature=0.9, seed=i,
                                                                    n=2 if i % 2 else 1))]
        mixed = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert [m["token_ids"] for m in mixed[0::2]] == [a["token_ids"] for a in alone]
    for out in mixed[1::2]:
        for sample in out.get("samples", [out]):
            assert sample["finish_reason"] == "stop"
            jsonschema.validate(parse(sample["text"]), SCHEMA)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    if "num_kvcache_blocks" in options:
        assert stats["num_preemptions"] > 0


def test_greedy_constrained_output_is_the_same_with_and_without_overlap(model_dir):
    """Overlap scheduling plans a step while the last one's tokens are in flight; a constrained
    sequence skips such steps (its mask needs its token), so its output is the synchronous one."""
    params = [constrained("json", SCHEMA, temperature=0), constrained("regex", r"[a-z]{3,9}\.", temperature=0)]
    runs = []
    for overlap in (True, False):
        with LLM(model_dir, max_model_len=MAX_LEN, async_scheduling=overlap) as llm:
            runs.append([o["token_ids"] for o in llm.generate([PROMPT, [9, 8, 7]], params, use_tqdm=False)])
    assert runs[0] == runs[1]


def test_seeded_constrained_sampling_is_reproducible_whatever_the_batch(llm):
    params = constrained("json", SCHEMA, temperature=1.0, seed=42)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0]["text"]
    others = [constrained("regex", r"[a-z]+", temperature=1.0, max_tokens=20), SamplingParams(max_tokens=20)]
    batched = llm.generate([PROMPT, [3, 4], [5, 6]], [params] + others, use_tqdm=False)[0]["text"]
    assert alone == batched


@pytest.mark.parametrize("constraint, error, words", [
    ({"json": {"type": "nonsense"}}, ValueError, "structured_outputs.json is not a valid JSON schema"),
    ({"regex": "(unclosed"}, ValueError, "structured_outputs.regex is not a valid regular expression"),
    ({"grammar": "root ::= undefined_rule"}, ValueError, "structured_outputs.grammar is not a valid EBNF grammar"),
])
def test_constraints_that_do_not_compile_are_value_errors(llm, constraint, error, words):
    with pytest.raises(error, match=re.escape(words)):
        llm.generate([PROMPT], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)),
                     use_tqdm=False)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=3), use_tqdm=False)[0]["token_ids"]  # (still serving)


@pytest.mark.parametrize("kwargs, error, words", [
    ({}, ValueError, "exactly one"),
    ({"regex": "a", "choice": ["b"]}, ValueError, "exactly one"),
    ({"json": "{not json"}, ValueError, "not valid JSON"),
    ({"json": [1]}, TypeError, "JSON schema"),
    ({"choice": []}, TypeError, "non-empty list"),
    ({"choice": ["a", ""]}, TypeError, "non-empty list"),
    ({"regex": 5}, TypeError, "non-empty string"),
])
def test_bad_structured_outputs_params(kwargs, error, words):
    with pytest.raises(error, match=words):
        StructuredOutputsParams(**kwargs)


def test_min_tokens_and_structured_outputs_are_refused_together():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a+"})


def test_a_grammar_that_compiles_too_long_fails_alone(llm, monkeypatch):
    """Compiling runs in the grammar threads with a time limit: past it the request is a ValueError
    and the engine serves the next request at once (the compile goes on in the background)."""
    grammars = llm.grammar_compiler()
    compile_, done = grammars._compile, threading.Event()
    monkeypatch.setattr(grammars, "timeout_s", 0.2)
    monkeypatch.setattr(grammars, "_compile", lambda params: (done.wait(60), compile_(params))[1])
    try:
        with pytest.raises(ValueError, match="took over 0.2 s"):  # (while the compile is still running)
            llm.generate([PROMPT], constrained("regex", "slow+"), use_tqdm=False)
    finally:
        done.set()
    monkeypatch.undo()
    assert llm.generate([PROMPT], SamplingParams(max_tokens=3), use_tqdm=False)[0]["token_ids"]


def test_the_same_schema_compiles_once(llm, monkeypatch):
    """Compiled grammars are cached by constraint: a schema seen before (an equal dict, a new
    object) is not compiled again."""
    llm.grammar_compiler().compile_request(constrained("regex", "y"))  # (the grammars exist from here on)
    grammars, calls = llm.grammars, []
    compile_ = grammars._compile
    monkeypatch.setattr(grammars, "_compile", lambda params: (calls.append(params), compile_(params))[1])
    schema = {"type": "object", "properties": {"only": {"type": "boolean"}}, "required": ["only"]}
    first = llm.grammar_compiler().compile_request(constrained("json", schema))
    again = [llm.grammar_compiler().compile_request(constrained("json", json.loads(json.dumps(schema)))) for _ in range(5)]
    assert len(calls) == 1 and all(g is first for g in again)


def test_constrained_rows_decode_every_step_under_overlap(model_dir):
    """Overlap scheduling launches step N+1's forward before N's tokens are in; a constrained row's
    mask needs them, so that step's sampling waits for N to be accounted for (as SGLang does):
    constrained requests beside free ones take as many steps as free ones alone."""
    schema = {"type": "string", "minLength": 24, "maxLength": 24}
    constrained_params = constrained("json", schema, temperature=1.0, max_tokens=24, ignore_eos=True)
    free = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)

    def steps(params) -> int:
        with LLM(model_dir, max_model_len=MAX_LEN, max_num_seqs=16) as llm:
            for i, p in enumerate(params):
                llm.add_request([i + 1, 2, 3], p)
            count = 0
            while not llm.is_finished():
                llm.step()
                count += 1
            return count
    assert steps([constrained_params, free] * 8) == steps([free] * 16)
