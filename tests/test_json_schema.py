"""Which JSON schema keywords xgrammar enforces (features/json_schema.py), with the evidence: a grammar
matcher over the compiled grammar of each schema takes the texts its schema allows and refuses the
others; for each keyword the check refuses, xgrammar alone lets through a text that breaks it, and
the check names the keyword and where it stands; the rewrites (oneOf of disjoint branches, enum
values of another type, true, patterns) are exact; deep schemas are ValueErrors, not
RecursionErrors; tool parameters get the same check."""
import json
import re

import pytest

xgr = pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (the 'structured' extra)")
jsonschema = pytest.importorskip("jsonschema")

from nanovllm.features.json_schema import MAX_DEPTH, UnsupportedSchema, check_schema  # noqa: E402
from nanovllm.features.structured_outputs import Grammars, json_grammar  # noqa: E402
from nanovllm.entrypoints.tool_parsers import HermesToolParser  # noqa: E402

SURROGATE = "\ud800".encode("utf-8", "surrogatepass")  # (its 3 bytes are invalid UTF-8)


@pytest.fixture(scope="module")
def accepts(model_dir):
    """accepts(ebnf, text): whether the grammar takes text (str, or bytes possibly invalid UTF-8) as
    a whole output, compiled for the tiny model's tokenizer as the engine compiles it."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    grammars = Grammars(tokenizer, 512, {tokenizer.eos_token_id})

    def accepts(ebnf: str, text) -> bool:
        matcher = xgr.GrammarMatcher(grammars.compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf)))
        return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)
    return accepts


def xgrammar_alone(schema) -> str:
    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))


def valid(schema, text) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))


# (schema, texts it allows, texts it does not): xgrammar enforces these keywords exactly (the texts
# are compact, with escapes only where a string is unbounded: what xgrammar generates).
ENFORCED = [
    ({"type": "integer", "minimum": -2, "maximum": 3}, ["-2", "0", "3"], ["-3", "4", "1.5", '"1"']),
    ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 3}, ["1", "2"], ["0", "3"]),
    ({"type": "number", "minimum": -1.5, "exclusiveMaximum": 2.5}, ["-1.5", "0.25", "2.4"],
     ["-1.6", "2.5", "3e0", "2.5000001"]),
    ({"type": "integer", "multipleOf": 3}, ["0", "9", "-3"], ["1", "10"]),
    ({"type": "integer", "multipleOf": 7, "exclusiveMinimum": -1, "maximum": 9999}, ["0", "7", "9996"], ["8", "-7"]),
    ({"type": "integer", "multipleOf": 1024}, ["0", "2048", "-1024"], ["1", "1025", "512"]),  # (MULTIPLE_OF_MAX)
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"ab"', '"日本語"'], ['"a"', '"abcd"', '"😀"']),
    ({"type": "string", "pattern": "^[a-c]+x?$"}, ['"abx"', '"c"'], ['"d"', '"ax x"', '""']),
    ({"type": "string", "format": "date"}, ['"2024-02-29"'], ['"yesterday"']),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}, "minItems": 2, "maxItems": 3},
     ['[1, "a"]', '[1, "a", "b"]'], ["[1]", '["a", "b"]', '[1, "a", "b", "c"]', "[1, 2]"]),
    ({"type": "array", "prefixItems": [{"type": "null"}], "unevaluatedItems": False},
     ["[]", "[null]"], ["[null, null]"]),
    ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "maxItems": 1},
     ["[]", "[true]"], ["[true, true]"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 2}},
      "required": ["a"], "additionalProperties": False},
     ['{"a": 1}', '{"a": 1, "b": "x"}'], ["{}", '{"b": "x"}', '{"a": 1, "c": 2}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "boolean"},
      "maxProperties": 2},
     ['{"a": 1, "x": true}'], ['{"a": 1, "x": 1}', '{"a": 1, "x": true, "y": false}']),
    ({"type": "object", "patternProperties": {"^p[0-9]$": {"type": "null"}}, "minProperties": 1},
     ['{"p1": null}'], ["{}", '{"p1": 1}', '{"q": null}']),
    ({"type": "object", "propertyNames": {"pattern": "^[xy]$"}, "additionalProperties": {"type": "integer"}},
     ['{"x": 1, "y": 2}'], ['{"z": 1}']),
    ({"type": "object", "unevaluatedProperties": {"type": "integer"}, "properties": {"a": {"type": "null"}}},
     ['{"a": null, "b": 1}'], ['{"a": null, "b": null}']),
    ({"enum": ["a", 1, None, [1]]}, ['"a"', "1", "null", "[1]"], ['"b"', "2", "[2]"]),
    ({"enum": [2**63 - 1, -2**63, 0.1]}, [str(2**63 - 1), str(-2**63), "0.1"], ["1", "0.10000000000000001"]),
    ({"const": {"k": [1, 2]}}, ['{"k":[1,2]}'], ['{"k":[1]}']),
    ({"anyOf": [{"type": "integer", "maximum": 0}, {"type": "string", "maxLength": 1}]}, ["-1", '"a"'], ["1", '"ab"']),
    ({"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 1}]}, ["1", '"a"'], ["1.5", "null"]),
    ({"allOf": [{"type": "integer", "maximum": 3}], "description": "one subschema"}, ["3"], ["4", "null"]),
    ({"$defs": {"small": {"type": "integer", "maximum": 3}}, "type": "array", "items": {"$ref": "#/$defs/small"},
      "maxItems": 2},
     ["[1, 3]"], ["[4]"]),
    ({"definitions": {"n": {"type": "null"}}, "$ref": "#/definitions/n"}, ["null"], ["1"]),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}}, ["{}", '{"next": {"next": {}}}'], ['{"next": 1}']),
    ({"type": ["string", "null"], "maxLength": 1}, ['"a"', "null"], ['"ab"', "1"]),
    ({"type": "object", "properties": {"any": True}, "required": ["any"]}, ['{"any": [1, "x"]}'], ["{}"]),
]


@pytest.mark.parametrize("schema, allowed, refused", ENFORCED, ids=[json.dumps(s)[:60] for s, _, _ in ENFORCED])
def test_keywords_xgrammar_enforces_pass_and_hold(accepts, schema, allowed, refused):
    grammar = json_grammar(schema)
    for text in allowed:
        assert valid(schema, text) and accepts(grammar, text), text
    for text in refused:
        assert not accepts(grammar, text), text


# (schema, the keyword refused, where, a text that breaks the schema and that xgrammar alone takes).
REFUSED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "", "[1, 1]"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 2}, "uniqueItems", "", "[1, 1]"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "contains", "", "[2]"),
    ({"type": "array", "items": {"type": "integer"}, "minContains": 2, "contains": {"const": 1}},
     "minContains", "", "[1, 2]"),
    ({"type": "array", "items": {"type": "integer"}, "maxContains": 1, "contains": {"const": 1}},
     "maxContains", "", "[1, 1]"),
    ({"type": "integer", "not": {"const": 1}}, "not", "", "1"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, "if", "", "7"),
    ({"type": "integer", "else": {"maximum": 2}, "if": {"minimum": 5}}, "else", "", "3"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired", "", '{"a": 1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas", "", '{"a": 1}'),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "additionalItems": False}, "additionalItems", "", None),
    ({"allOf": [{"type": "integer"}, {"maximum": 3}]}, "allOf", "", "null"),
    ({"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]}, "oneOf", "", "1"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "", "1"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "", "0.3"),
    ({"type": "integer", "multipleOf": 1.5}, "multipleOf", "", "1"),
    ({"type": "integer", "multipleOf": 1025}, "multipleOf", "", "1026"),
    ({"type": "integer", "multipleOf": 3, "maximum": 10}, "multipleOf", "", "1"),
    ({"type": "integer", "multipleOf": 7, "minimum": 0, "exclusiveMaximum": 10001}, "multipleOf", "", "8"),
    ({"type": "string", "pattern": "^a*$", "maxLength": 2}, "maxLength", "", '"aaaa"'),
    ({"type": "string", "format": "date", "minLength": 11}, "minLength", "", '"2024-01-01"'),
    ({"type": "string", "format": "date", "pattern": "^x"}, "pattern", "", '"2024-01-01"'),
    ({"type": "object", "required": ["x"], "additionalProperties": {"type": "integer"}}, "required", "", "{}"),
    ({"type": "object", "required": ["x"]}, "required", "", "{}"),
    ({"type": "object", "properties": {"ab": {"type": "string"}}, "patternProperties": {"^a": {"type": "integer"}}},
     "patternProperties", "", '{"ab": "x"}'),
    ({"type": "object", "properties": {"abc": {"type": "integer"}}, "propertyNames": {"maxLength": 2}},
     "propertyNames", "", '{"abc": 1}'),
    ({"maximum": 3}, "maximum", "", "4"),
    ({"type": "object", "properties": {"s": {"maxLength": 1}}}, "maxLength", "/properties/s", '{"s": "ab"}'),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "allOf": [{}]}, "type", "", '"x"'),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 1}, "maxLength", "", '"ab"'),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}], "type": "string"}, "type", "", "1"),
    ({"enum": [1, 2], "maximum": 1}, "maximum", "", "2"),
    # a second dispatcher beside the first: xgrammar reads the first only
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "anyOf": [{"type": "string", "maxLength": 1}]},
     "anyOf", "", '"ab"'),
    ({"const": 1, "enum": [2]}, "enum", "", "1"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "integer", "minimum": 0}]}, "oneOf", "", "1"),
    ({"type": "object", "propertyNames": {"anyOf": [{"maxLength": 1}]}, "additionalProperties": {"type": "null"}},
     "maxLength", "/propertyNames/anyOf/0", '{"ab": null}'),
    ({"$defs": {"t": {"type": "array", "uniqueItems": True, "items": {"type": "null"}}},
      "type": "object", "properties": {"t": {"$ref": "#/$defs/t"}}}, "uniqueItems", "/$defs/t", '{"t": [null, null]}'),
    ({"type": "string", "pattern": '^"$'}, "pattern", "", None),          # (xgrammar writes '"""': invalid JSON)
    ({"type": "string", "pattern": "^\\n$"}, "pattern", "", None),        # (a raw newline: invalid JSON)
    ({"type": "string", "pattern": "^\\\\n$"}, "pattern", "", '"\\n"'),   # (a backslash and n, written as an escape)
    ({"type": "string", "pattern": "^(?!a)\\w$"}, "pattern", "", '"a"'),
    ({"type": "string", "pattern": "a$b"}, "pattern", "", '"ab"'),
    ({"type": "string", "pattern": "^[ -\\uffff]$"}, "pattern", "", None),  # (lets surrogates through)
    ({"type": "object", "patternProperties": {'^"': {"type": "null"}}}, "patternProperties", "", None),
    ({"type": "object", "properties": {"a": {"$id": "inner", "type": "null"}}}, "$id", "/properties/a", None),
    ({"$ref": "https://example.com/s.json"}, "$ref", "", None),
    ({"const": 12345678901234567890}, "const", "", "1.2345678901234567e+19"),
    ({"const": 2**63}, "const", "", None),  # (the first integer past 64 bits each way)
    ({"enum": [-2**63 - 1]}, "enum", "", "-9.223372036854776e+18"),
    ({"type": "array", "items": {"enum": [1, {"k": [-2**64]}]}}, "enum", "/items", None),
]


@pytest.mark.parametrize("schema, keyword, where, breaking", REFUSED,
                         ids=[f"{k}{w}-{i}" for i, (_, k, w, _) in enumerate(REFUSED)])
def test_keywords_xgrammar_would_not_enforce_are_refused_by_name(accepts, schema, keyword, where, breaking):
    if breaking is not None:  # (the evidence: xgrammar alone lets a text that breaks the schema through)
        assert not valid(schema, breaking) and accepts(xgrammar_alone(schema), breaking)
    named = f"the keyword {re.escape(repr(keyword))} \\(at {re.escape(where or 'the root')}\\)"
    with pytest.raises(ValueError, match=named):
        json_grammar(schema)


@pytest.mark.parametrize("schema, why", [
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "x"], "additionalProperties": False},
     "the keyword 'required' (at the root) leaves no value valid: it requires 'x', which additionalProperties false forbids"),
    ({"type": "string", "const": 1}, "the keyword 'const' (at the root) leaves no value valid"),
    ({"type": "object", "properties": {"e": {"type": "integer", "enum": ["a", "b"]}}},
     "the keyword 'enum' (at /properties/e) leaves no value valid"),
    ({"type": []}, "the keyword 'type' (at the root) leaves no value valid"),
    (False, "the schema is false"),
])
def test_unsatisfiable_schemas_are_value_errors(schema, why):
    """xgrammar drops a required name that properties does not list, so with additionalProperties
    false it generated {} for a schema no object satisfies; such schemas are refused."""
    with pytest.raises(ValueError, match=re.escape(why)):
        json_grammar(schema)


def test_exact_rewrites(accepts):
    """oneOf of provably disjoint branches becomes anyOf (types, finite values, or a tagged union
    through $ref); enum and const values of another type than "type" go; true becomes {}."""
    tagged = {"$defs": {"cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                                "required": ["kind", "lives"], "additionalProperties": False},
                        "dog": {"type": "object", "properties": {"kind": {"enum": ["dog", "puppy"]}},
                                "required": ["kind"], "additionalProperties": False}},
              "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}, {"type": "null"}, {"enum": [1, "x"]}]}
    assert "anyOf" in check_schema(tagged) and "oneOf" not in check_schema(tagged)
    grammar = json_grammar(tagged)
    for text in ('{"kind": "cat", "lives": 9}', '{"kind": "puppy"}', "null", '"x"'):
        assert valid(tagged, text) and accepts(grammar, text)
    assert not accepts(grammar, '{"kind": "cat"}')
    assert check_schema({"type": "string", "enum": ["a", 1, "b", None]}) == {"type": "string", "enum": ["a", "b"]}
    assert not accepts(json_grammar({"type": "string", "enum": ["a", 1]}), "1")  # (xgrammar alone takes it)
    assert check_schema({"type": "array", "prefixItems": [True]}) == {"type": "array", "prefixItems": [{}]}
    assert check_schema(True) == {} and check_schema("true") == {}
    schema = {"type": "object", "properties": {"x": {"oneOf": [{"type": "integer"}, {"type": "integer"}]}}}
    with pytest.raises(ValueError, match="'oneOf' \\(at /properties/x\\).*branches 0 and 1"):
        check_schema(schema)
    assert schema["properties"]["x"]["oneOf"]  # (the caller's schema is not rewritten: a copy is)


def test_patterns_are_kept_to_json_strings(accepts):
    """xgrammar's '.' and [^...] let surrogates through (invalid UTF-8): they are rewritten to keep
    them out, which changes nothing else they match."""
    assert accepts(xgrammar_alone({"type": "string", "pattern": "^.$"}), b'"' + SURROGATE + b'"')  # (the evidence)
    for pattern, allowed, refused in [("^.{1,2}$", ['"é"', '"a😀"'], ['"abc"']),
                                      ("^[^-a]$", ['"b"'], ['"a"', '"-"']),
                                      ("^(?:x|[^x])y$", ['"xy"', '"zy"'], ['"y"'])]:
        schema = {"type": "string", "pattern": pattern}
        grammar = json_grammar(schema)
        for text in allowed:
            assert valid(schema, text) and accepts(grammar, text), (pattern, text)
        for text in refused + [b'"' + SURROGATE + b'"', b'"' + SURROGATE + b'y"']:
            assert not accepts(grammar, text), (pattern, text)


def test_deep_schemas_are_value_errors_not_recursion_errors():
    schema = {"type": "integer"}
    for _ in range(MAX_DEPTH):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    assert json_grammar(schema)  # (MAX_DEPTH levels of subschemas pass)
    for depth in (MAX_DEPTH + 1, 5000):  # (5000: deeper than Python's recursion limit)
        schema = {"type": "integer"}
        for _ in range(depth):
            schema = {"type": "array", "items": schema}
        with pytest.raises(ValueError, match=f"nests deeper than {MAX_DEPTH} levels"):
            json_grammar(schema)
    with pytest.raises(ValueError, match="nests deeper"):
        json_grammar('{"items": ' * 5000 + "{}" + "}" * 5000)
    chain = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(MAX_DEPTH + 5)}, "$ref": "#/$defs/d0"}
    chain["$defs"][f"d{MAX_DEPTH + 5}"] = {"type": "null"}
    with pytest.raises(UnsupportedSchema, match="nests deeper"):
        check_schema(chain)


def test_tool_parameters_get_the_same_check():
    """The grammar of a required tool call holds each tool's parameters schema: a refused keyword
    there is a ValueError naming it (the server's 400 on tools)."""
    tools = [{"name": "tag", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}]
    with pytest.raises(ValueError, match="the parameters of 'tag': the keyword 'uniqueItems' \\(at /properties/tags\\)"):
        HermesToolParser().grammar(tools, parallel=False)
    tools[0]["parameters"]["properties"]["tags"]["maxItems"] = 1  # (unique whatever the items)
    assert "call_json" in HermesToolParser().grammar(tools, parallel=False)
