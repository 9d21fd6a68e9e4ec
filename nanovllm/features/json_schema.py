"""JSON schemas whose every output validates: check_schema() passes a schema whose keywords
xgrammar (0.2.9) enforces, rewrites the few it gets wrong where a simple rewrite is provably
exact, and raises a ValueError naming any other keyword and where it stands (vLLM likewise
refuses, for xgrammar, the keywords it does not support).

What xgrammar does, found keyword by keyword with its grammar matcher (tests/test_json_schema.py):
it reads the first of $ref, const, enum, anyOf, oneOf, allOf in a schema and nothing beside it;
otherwise it generates the schema's "type" (an object if it has properties, an array if it has
items, any value if neither) with that type's keywords only (maxLength alone constrains nothing).
It ignores uniqueItems, contains, not, if/then/else, dependentRequired/Schemas, multipleOf for a
number and for an integer bounded on one side or over a wide range, minLength/maxLength beside a
pattern or a format, a pattern beside a format, and a required name that properties does not list;
allOf of two or more subschemas becomes "any value", and a oneOf it cannot prove disjoint anyOf. A
property both listed and matched by patternProperties is checked against properties only, and
listed properties not against propertyNames. Its patterns match the whole string (a JSON schema
pattern may match anywhere: fewer strings, all valid), but it writes a pattern's literal quotes,
backslashes and control characters into the JSON string unescaped (invalid JSON), lets '.', [^...]
and ranges through the UTF-16 surrogates (invalid UTF-8), and ignores lookaheads and anchors inside
a pattern.

It also narrows, soundly: strict mode (xgrammar's default) allows an object only the properties
its schema names (additionalProperties and unevaluatedProperties left out mean false) and an array
only the items its schema describes; strings with a length bound or a pattern take no escapes;
properties come in the schema's order.
"""
import json
import math
import re
from urllib.parse import unquote

# Subschemas nested deeper than this are refused: xgrammar recurses in C++ and its grammar text
# grows with the square of the depth (arrays nested 100 deep: 0.3 MB of grammar, 0.2 s; 300: 2.5
# MB, 2.3 s; 900: 22 MB, 57 s), while real schemas nest through $defs and stay far below.
MAX_DEPTH = 100
IGNORED = "xgrammar ignores it, so outputs could break it"

# Keyword -> (the instance types it constrains, None for every type; why it is refused, None where
# xgrammar enforces it exactly or a check below makes sure it does). A keyword of a type the
# schema cannot generate is irrelevant, as in JSON Schema.
NUMBER, STRING, ARRAY, OBJECT = ("integer", "number"), ("string",), ("array",), ("object",)
KEYWORDS = {
    "type": (None, None),
    "not": (None, IGNORED), "if": (None, IGNORED), "then": (None, IGNORED), "else": (None, IGNORED),
    "$dynamicRef": (None, IGNORED), "$recursiveRef": (None, IGNORED),
    "additionalItems": (None, "it is draft 7's (2020-12 has prefixItems and items), and " + IGNORED),
    "dependencies": (None, "it is draft 7's (2020-12 has dependentRequired), and " + IGNORED),
    "minimum": (NUMBER, None), "maximum": (NUMBER, None),
    "exclusiveMinimum": (NUMBER, None), "exclusiveMaximum": (NUMBER, None),
    "multipleOf": (NUMBER, None),  # (for integers, unbounded or in a small range: check_multiple_of)
    "minLength": (STRING, None), "maxLength": (STRING, None),  # (not beside pattern or format: check_length)
    "pattern": (STRING, None),  # (not beside a format; rewritten or refused: check_pattern)
    "format": (STRING, None),   # an annotation in 2020-12; xgrammar shapes the strings of XGRAMMAR_FORMATS
    "items": (ARRAY, None), "prefixItems": (ARRAY, None), "unevaluatedItems": (ARRAY, None),
    "minItems": (ARRAY, None), "maxItems": (ARRAY, None),
    "uniqueItems": (ARRAY, None),  # (true only where maxItems <= 1: check_unique_items)
    "contains": (ARRAY, IGNORED), "maxContains": (ARRAY, IGNORED),
    "minContains": (ARRAY, "xgrammar reads it as minItems, so outputs could break it"),
    "properties": (OBJECT, None), "additionalProperties": (OBJECT, None), "unevaluatedProperties": (OBJECT, None),
    "patternProperties": (OBJECT, None),  # (not matching a listed property: check_pattern_properties)
    "propertyNames": (OBJECT, None),      # (not beside properties: check_property_names)
    "minProperties": (OBJECT, None), "maxProperties": (OBJECT, None),
    "required": (OBJECT, None),           # (only names properties lists: check_required)
    "dependentRequired": (OBJECT, IGNORED), "dependentSchemas": (OBJECT, IGNORED),
}
# xgrammar reads the first of these a schema holds, and no other keyword beside it.
DISPATCHERS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# Keywords that only describe, or hold subschemas for $ref to point at: a validator's verdict does
# not depend on them. Unknown keywords are ignored too, as JSON Schema 2020-12 says.
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
               "$schema", "$id", "$anchor", "$vocabulary", "contentEncoding", "contentMediaType", "contentSchema",
               "$defs", "definitions"}
# The formats xgrammar generates strings of (a regular expression each; it drops pattern,
# minLength and maxLength beside them). Other formats stay annotations: any string.
XGRAMMAR_FORMATS = {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                    "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer"}
# Where xgrammar takes the schema false (it refuses it anywhere else, though it may be satisfiable).
FALSE_ALLOWED = {"additionalProperties", "items", "unevaluatedItems", "unevaluatedProperties"}
SCHEMA_MAPS = ("properties", "patternProperties")                       # name -> subschema
SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")               # [subschema, ...]
SCHEMA_VALUES = ("items", "unevaluatedItems", "additionalProperties", "unevaluatedProperties", "propertyNames")
TYPE_TESTS = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer(),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


class UnsupportedSchema(ValueError):
    """A JSON schema (valid or not) that xgrammar would not enforce; the message says where."""


def refuse(keyword: str, path: str, why: str):
    raise UnsupportedSchema(f"the keyword {keyword!r} (at {path or 'the root'}) is not supported: {why}")


def unsatisfiable(keyword: str, path: str, why: str):
    raise UnsupportedSchema(f"the keyword {keyword!r} (at {path or 'the root'}) leaves no value valid: {why}")


def pointer(path: str, *names) -> str:
    """path (a JSON pointer) extended by names, escaped as RFC 6901 says."""
    return path + "".join("/" + str(name).replace("~", "~0").replace("/", "~1") for name in names)


def check_schema(schema: str | dict | bool) -> dict:
    """A copy of schema (JSON text or its value) for xgrammar to compile, whose every output
    validates against schema, else UnsupportedSchema. One iterative pass over the subschemas it
    reaches (through $ref too, each once), MAX_DEPTH levels at most."""
    try:  # (a copy to rewrite; json's C code refuses depths near the recursion limit itself)
        root = json.loads(schema if isinstance(schema, str) else json.dumps(schema))
    except RecursionError:
        raise UnsupportedSchema(f"the schema nests deeper than {MAX_DEPTH} levels") from None
    if root is True:
        return {}
    if root is False:
        raise UnsupportedSchema("the schema is false: no value is valid")
    if not isinstance(root, dict):
        raise ValueError(f"a JSON schema is an object or a boolean, got {root!r}")
    stack, seen = [(root, "", 0, None)], {id(root)}  # (schema, its path, depth, type when it has none)
    while stack:
        node, path, depth, default_type = stack.pop()
        if depth > MAX_DEPTH:
            raise UnsupportedSchema(f"the schema nests deeper than {MAX_DEPTH} levels")
        for keyword, holder, key, child_path in check_node(root, node, path, default_type):
            child = holder[key]
            if child is True:  # (true and {} are the same schema; xgrammar takes only {} everywhere)
                holder[key] = child = {}
            if child is False:
                if keyword not in FALSE_ALLOWED:
                    refuse(keyword, path, f"it holds the schema false (at {child_path}), which xgrammar takes "
                           f"only as {', '.join(sorted(FALSE_ALLOWED))}")
                continue
            if not isinstance(child, dict):
                raise ValueError(f"the keyword {keyword!r} (at {path or 'the root'}) holds {child!r} where a "
                                 "schema (an object or a boolean) belongs")
            if id(child) not in seen:
                seen.add(id(child))
                stack.append((child, child_path, depth + 1, "string" if keyword == "propertyNames" else None))
    return root


def rebase_refs(schema, base: str):
    """A copy of schema to stand at the JSON pointer base of a larger schema (a tool's parameters
    inside the schema of its call): each local $ref ("#/$defs/X", "#") becomes "#" + base + "/$defs/X".
    Only keywords holding subschemas are walked (an enum's or a default's {"$ref": ...} is data)."""
    copy = json.loads(json.dumps(schema))
    stack = [copy]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            node["$ref"] = "#" + base + node["$ref"][1:]
        for keyword in (*SCHEMA_MAPS, "$defs", "definitions"):
            if isinstance(node.get(keyword), dict):
                stack.extend(node[keyword].values())
        for keyword in SCHEMA_LISTS:
            if isinstance(node.get(keyword), list):
                stack.extend(node[keyword])
        stack.extend(node[keyword] for keyword in SCHEMA_VALUES if keyword in node)
    return copy


def check_node(root: dict, node: dict, path: str, default_type: str | None):
    """Checks (and rewrites) one schema; yields (keyword, holder, key, path) for each subschema
    xgrammar reads, holder[key] being the subschema."""
    if "$id" in node and node is not root:
        refuse("$id", path, "a nested $id changes what the $refs inside point to, and xgrammar resolves "
               "every $ref from the root")
    dispatcher = next((k for k in DISPATCHERS if k in node), None)
    if dispatcher is not None:
        for k in node:
            if (k != dispatcher and (k in KEYWORDS or k in DISPATCHERS) and k != "format"  # (an annotation)
                    and not (k == "type" and dispatcher in ("const", "enum"))):
                refuse(k, path, f"xgrammar reads only {dispatcher!r} in a schema that has it, so outputs could "
                       "break it")
        yield from DISPATCH_CHECKS[dispatcher](root, node, path, default_type)
        return
    types = generated_types(node, path, default_type)
    for k in list(node):
        if k not in KEYWORDS:
            continue
        applies_to, why = KEYWORDS[k]
        if applies_to is not None:
            if types is None:
                refuse(k, path, f"xgrammar applies it only in a schema whose \"type\" is {' or '.join(applies_to)}, "
                       "and this one has none, so outputs could break it")
            if not types & set(applies_to):
                continue  # (a keyword of a type the schema does not generate: irrelevant)
        if why is not None:
            refuse(k, path, why)
        if k in TYPE_CHECKS:
            TYPE_CHECKS[k](root, node, path, types)
        if k in SCHEMA_MAPS:
            for name in expect(node, k, dict, path):
                yield k, node[k], name, pointer(path, k, name)
        elif k in SCHEMA_LISTS:
            for i in range(len(expect(node, k, list, path))):
                yield k, node[k], i, pointer(path, k, i)
        elif k in SCHEMA_VALUES:
            yield k, node, k, pointer(path, k)


def generated_types(node: dict, path: str, default_type: str | None) -> set[str] | None:
    """The instance types xgrammar generates for a schema without a dispatcher (None: any value):
    its "type", else the default (property names are strings), else object or array by keyword."""
    if "type" in node:
        names = node["type"] if isinstance(node["type"], list) else [node["type"]]
        if not names:
            unsatisfiable("type", path, "it lists no type")
        return {name for name in names if isinstance(name, str)}  # (xgrammar refuses unknown names itself)
    if default_type is not None:
        return {default_type}
    if any(k in node for k in ("properties", "additionalProperties", "unevaluatedProperties")):
        return {"object"}
    if any(k in node for k in ("items", "prefixItems", "unevaluatedItems")):
        return {"array"}
    return None


def expect(node: dict, keyword: str, kind: type, path: str):
    value = node[keyword]
    if not isinstance(value, kind) or (kind is list and not value and keyword in ("anyOf", "oneOf", "allOf", "enum")):
        raise ValueError(f"the keyword {keyword!r} (at {path or 'the root'}) must be a "
                         f"{'non-empty ' if kind is list else ''}{'list' if kind is list else 'object'}, got {value!r}")
    return value


# --- the dispatchers ---------------------------------------------------------------------------

def check_ref(root, node, path, default_type):
    target, target_path = resolve(root, node["$ref"], path)
    if target is False:
        refuse("$ref", path, "it points to the schema false, which xgrammar does not take")
    yield "$ref", {"$ref": target}, "$ref", target_path  # (the walk reaches what it points to, once)


def resolve(root: dict, ref, path: str):
    """The subschema a $ref points to and its path: only pointers into this document, through
    objects, as xgrammar resolves them."""
    if ref == "#":
        return root, ""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        refuse("$ref", path, f"it points outside this schema ({ref!r}); only '#' and '#/...' are resolved")
    target = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            raise ValueError(f"the keyword '$ref' (at {path or 'the root'}) points to {ref!r}, which this schema "
                             "does not hold")
        target = target[part]
    return target, unquote(ref[1:])


def check_values(root, node, path, default_type):
    """const and enum: xgrammar generates their values and ignores "type" beside them, so the
    values of other types go (exact: they were not valid)."""
    keyword = "const" if "const" in node else "enum"
    values = [node["const"]] if keyword == "const" else expect(node, "enum", list, path)
    inside = list(values)
    while inside:  # (every number a value holds, arrays and objects included)
        value = inside.pop()
        if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**63:
            refuse(keyword, path, f"xgrammar writes {value}, beyond 64 bits, as a float (another value)")
        inside += value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    kept = typed_values(node, default_type)
    if not kept:
        unsatisfiable(keyword, path, f"none of its values is of the type {node.get('type', default_type)!r}")
    if len(kept) < len(values):
        node.pop("const", None)
        node["enum"] = kept
    return ()


def typed_values(node: dict, default_type: str | None = None) -> list:
    values = [node["const"]] if "const" in node else node["enum"]
    names = node.get("type", default_type)
    if names is None:
        return values
    names = names if isinstance(names, list) else [names]
    return [v for v in values if any(TYPE_TESTS.get(name, lambda v: False)(v) for name in names)]


def check_any_of(root, node, path, default_type):
    for i in range(len(expect(node, "anyOf", list, path))):
        yield "anyOf", node["anyOf"], i, pointer(path, "anyOf", i)


def check_one_of(root, node, path, default_type):
    """oneOf whose branches provably no value satisfies two of is anyOf (which xgrammar enforces);
    any other is refused: xgrammar would let a value valid against two branches through."""
    branches = expect(node, "oneOf", list, path)
    for i, a in enumerate(branches):
        for j in range(i + 1, len(branches)):
            if not disjoint(root, a, branches[j]):
                refuse("oneOf", path, f"its branches {i} and {j} are not provably disjoint (by their types, their "
                       "const or enum values, or a required property's), and xgrammar would let a value valid "
                       "against both through")
    node["anyOf"] = node.pop("oneOf")
    for i in range(len(branches)):
        yield "oneOf", branches, i, pointer(path, "oneOf", i)  # (paths name what the caller wrote)


def check_all_of(root, node, path, default_type):
    if len(expect(node, "allOf", list, path)) > 1:
        refuse("allOf", path, "xgrammar takes allOf of one subschema only (with more it allows any value)")
    yield "allOf", node["allOf"], 0, pointer(path, "allOf", 0)


DISPATCH_CHECKS = {"$ref": check_ref, "const": check_values, "enum": check_values, "anyOf": check_any_of,
                   "oneOf": check_one_of, "allOf": check_all_of}


def disjoint(root: dict, a, b) -> bool:
    """Whether no value is valid against both schemas, proven from their types and finite values,
    or from a required property they both give different finite values (a tagged union)."""
    a, b = dereferenced(root, a), dereferenced(root, b)
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    if finite(a) is not None and finite(b) is not None:
        return not finite(a) & finite(b)
    for x, y in ((a, b), (b, a)):
        if finite(x) is not None and declared_types(y) is not None:
            return not any(TYPE_TESTS.get(name, lambda v: False)(v)
                           for v in typed_values(x) for name in declared_types(y))
    if declared_types(a) is not None and declared_types(b) is not None:
        if not widened(declared_types(a)) & widened(declared_types(b)):
            return True
    if a.get("type") == b.get("type") == "object":  # (both generate objects, both require the tag)
        required = set(a.get("required", [])) & set(b.get("required", []))
        pa, pb = a.get("properties", {}), b.get("properties", {})
        for name in required & set(pa) & set(pb):
            va, vb = finite(dereferenced(root, pa[name])), finite(dereferenced(root, pb[name]))
            if va is not None and vb is not None and not va & vb:
                return True
    return False


def dereferenced(root: dict, schema):
    for _ in range(MAX_DEPTH):  # (a cycle of $refs proves nothing)
        if not isinstance(schema, dict) or "$ref" not in schema:
            return schema
        schema = resolve(root, schema["$ref"], "")[0]
    return schema


def finite(schema):
    """The values of a const or enum schema as comparable keys (1 and 1.0 equal, true and 1 not),
    None where it is not one or a value is an array or object (not compared: not proven)."""
    if not isinstance(schema, dict) or ("const" not in schema and not isinstance(schema.get("enum"), list)):
        return None
    keys = set()
    for v in typed_values(schema):
        if isinstance(v, (list, dict)):
            return None
        keys.add((type(v) is bool, v))
    return keys


def declared_types(schema: dict) -> set[str] | None:
    names = schema.get("type")
    if names is None or any(k in schema for k in DISPATCHERS):
        return None
    return set(names if isinstance(names, list) else [names])


def widened(names: set[str]) -> set[str]:
    return names | {"number"} if "integer" in names else names | {"integer"} if "number" in names else names


# --- a type's keywords that xgrammar enforces only in some cases -------------------------------

# xgrammar enforces an integer's multipleOf with a modulo automaton only up to these sizes, and
# ignores it past them (and beside a bound on one side only).
MULTIPLE_OF_MAX = 1024
MULTIPLE_OF_RANGE_MAX = 10000  # integers between the bounds


def check_multiple_of(root, node, path, types):
    value = node["multipleOf"]
    if "number" in types:
        refuse("multipleOf", path, "xgrammar ignores it for type number (it enforces it for integers)")
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= MULTIPLE_OF_MAX
            and float(value).is_integer()):
        refuse("multipleOf", path, f"xgrammar enforces only a whole multipleOf up to {MULTIPLE_OF_MAX}, got {value!r}")
    bounds = [node[k] for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum") if k in node]
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds):
        return  # (xgrammar refuses those itself)
    lows = [math.ceil(node["minimum"])] if "minimum" in node else []
    lows += [math.floor(node["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in node else []
    highs = [math.floor(node["maximum"])] if "maximum" in node else []
    highs += [math.ceil(node["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in node else []
    if bool(lows) != bool(highs) or lows and min(highs) - max(lows) + 1 > MULTIPLE_OF_RANGE_MAX:
        refuse("multipleOf", path, "xgrammar ignores it beside a bound on one side only, or bounds more than "
               f"{MULTIPLE_OF_RANGE_MAX} integers apart")


def check_length(root, node, path, types):
    for k in ("minLength", "maxLength"):
        if k in node and node.get("format") in XGRAMMAR_FORMATS:
            refuse(k, path, f"xgrammar drops it beside the format {node['format']!r}, so outputs could break it")
        if k in node and "pattern" in node:
            refuse(k, path, "xgrammar drops it beside 'pattern', so outputs could break it (bound the pattern instead)")


def check_pattern(root, node, path, types):
    if node.get("format") in XGRAMMAR_FORMATS:
        refuse("pattern", path, f"xgrammar drops it beside the format {node['format']!r}, so outputs could break it")
    if not isinstance(node["pattern"], str):
        raise ValueError(f"the keyword 'pattern' (at {path or 'the root'}) must be a string, got {node['pattern']!r}")
    node["pattern"] = json_safe_pattern(node["pattern"], "pattern", path)


def check_unique_items(root, node, path, types):
    if node["uniqueItems"] is True and not (isinstance(node.get("maxItems"), int) and node["maxItems"] <= 1):
        refuse("uniqueItems", path, IGNORED)


def check_required(root, node, path, types):
    names = node["required"]
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"the keyword 'required' (at {path or 'the root'}) must be a list of strings, got {names!r}")
    listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    for name in names:
        if name not in listed:
            if node.get("additionalProperties") is False and not node.get("patternProperties"):
                unsatisfiable("required", path, f"it requires {name!r}, which additionalProperties false forbids")
            refuse("required", path, f"it names {name!r}, which properties does not list, and xgrammar enforces "
                   "required only for the names properties lists")


def check_pattern_properties(root, node, path, types):
    patterns = expect(node, "patternProperties", dict, path)
    for name in node.get("properties") or {}:
        for pattern in patterns:
            try:
                matches = re.search(pattern, name) is not None
            except re.error:
                matches = True  # (not provably apart)
            if matches:
                refuse("patternProperties", path, f"its pattern {pattern!r} matches the listed property {name!r}, "
                       "which xgrammar checks against properties only")
    node["patternProperties"] = {json_safe_pattern(p, "patternProperties", path): s for p, s in patterns.items()}


def check_property_names(root, node, path, types):
    if node.get("properties"):
        refuse("propertyNames", path, "xgrammar does not check the names properties lists against it")


TYPE_CHECKS = {"multipleOf": check_multiple_of, "minLength": check_length, "maxLength": check_length,
               "pattern": check_pattern, "uniqueItems": check_unique_items, "required": check_required,
               "patternProperties": check_pattern_properties, "propertyNames": check_property_names}


# --- patterns ----------------------------------------------------------------------------------

SURROGATES = r"\uD800-\uDFFF"
# '.' as ECMA-262 means it (no line terminators), off the surrogates: xgrammar's '.' lets them through.
ANY_CHARACTER = r"[^\n\r\u2028\u2029" + SURROGATES + "]"
RAW = ("matches a control character, a quote, a backslash or a surrogate, which xgrammar would write raw into "
       "the JSON string (invalid JSON or UTF-8)")


def json_safe_pattern(pattern: str, keyword: str, path: str) -> str:
    """pattern as xgrammar should read it to generate only JSON strings that it matches: '.' and
    negated classes kept off the surrogates. UnsupportedSchema for syntax xgrammar does not take
    or enforce, for characters it would write unescaped, and for classes whose characters differ
    between regex dialects (ECMA-262, Python's re that validators use, xgrammar's)."""
    def no(why):
        refuse(keyword, path, f"the pattern {pattern!r} {why}")

    out, i = [], 0
    in_class = negated = False  # (inside [...], [^...])
    start, dash = None, False   # (in a positive class: the code point a range may start from; '-' read after it)
    while i < len(pattern):
        c, step, code = pattern[i], 1, None  # (code: the character a literal stands for)
        was_in_class, was_negated = in_class, negated
        if c == "\\":
            e = pattern[i + 1:i + 2]
            step = 2
            if e in ("x", "u"):
                digits = pattern[i + 2:i + (4 if e == "x" else 6)]
                if not re.fullmatch("[0-9A-Fa-f]{%d}" % (2 if e == "x" else 4), digits):
                    no(f"holds a malformed \\{e} escape")
                code, step = int(digits, 16), 2 + len(digits)
            elif e in ("d", "w", "s"):
                if in_class and negated:
                    no(f"negates \\{e}, whose characters differ between regex dialects")
            elif e in ("D", "S", "W"):
                no(f"uses \\{e}, whose characters differ between regex dialects")
            elif e in ("n", "r", "t", "f", "v", "0"):
                no(RAW)
            elif not e or e.isalnum() or e.isspace():
                no(f"uses \\{e}, which xgrammar does not take or does not enforce")
            else:
                code = ord(e)  # (an escaped punctuation character stands for itself)
            token = pattern[i:i + step]
        elif in_class:
            token = c
            if c == "]":
                in_class = negated = False
            elif c != "-":
                code = ord(c)
        elif c == "[":
            in_class, negated, start, dash = True, pattern[i + 1:i + 2] == "^", None, False
            token = "["
            if negated:
                token, step = "[^" + SURROGATES, 2
                if pattern[i + 2:i + 3] == "-":  # (a leading '-' must stay a character after the range)
                    token, step = token + "\\-", 3
        elif c == ".":
            token = ANY_CHARACTER
        elif c == "(" and pattern[i + 1:i + 2] == "?":
            if pattern[i + 2:i + 3] != ":":
                no("uses '(?' (a lookaround, named group or flag), which xgrammar does not take or enforce")
            token, step = "(?:", 3
        elif c == "^" and out and out[-1] not in ("(", "(?:", "|"):
            no("has '^' inside it, which xgrammar does not enforce")
        elif c == "$" and pattern[i + 1:i + 2] not in ("", ")", "|"):
            no("has '$' inside it, which xgrammar does not enforce")
        else:
            token, code = c, ord(c)
        if code is not None and not was_negated and (code < 0x20 or code in (0x22, 0x5C) or 0xD800 <= code <= 0xDFFF):
            no(RAW)  # (a negated class only keeps them out)
        if was_in_class and not was_negated:  # (a range through the surrogates lets them through)
            if token == "-" and start is not None:
                dash = True
            elif code is not None and dash:
                if start <= 0xDFFF and code >= 0xD800:
                    no("has a range through the UTF-16 surrogates (invalid UTF-8)")
                start, dash = None, False
            else:
                start, dash = code, False
        out.append(token)
        i += step
    return "".join(out)
