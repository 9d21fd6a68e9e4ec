"""A hypothesis strategy of JSON values valid against a JSON schema, written for the request
schemas in the server's OpenAPI document (test_server_fuzz.py draws its valid bodies from it).

It understands exactly the keywords that document uses, listed in KEYWORDS; any other keyword, or
one where it does not belong, is a SchemaError naming it and where it is, so that a new kind of
field cannot silently drop out of the fuzz. (hypothesis-jsonschema did this job for any schema,
but it reaches into hypothesis's private internals and fails with new hypothesis releases.)"""
import math

from hypothesis import strategies as st

# What each type may carry besides "type" itself (the schema's constraints, all honoured).
KEYWORDS = {
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems"},
    "string": {"minLength"},
    "integer": {"minimum", "maximum"},
    "number": {"minimum", "maximum"},
    "boolean": set(),
    "null": set(),
}
# Keywords that describe a value without constraining it: ignored wherever they are.
ANNOTATIONS = {"title", "description", "default"}
# At most this many array items, so that a body stays quick to draw and to serve (a larger
# minItems raises the bound).
MAX_ITEMS = 4
# At most this many members an object's schema does not name, where it allows them, each any JSON
# value of up to MAX_LEAVES scalars: enough to show how the server takes them, and cheap to draw.
MAX_EXTRA = 2
MAX_LEAVES = 4
# An optional property is drawn once in this many values, each on its own: with ~25 optional
# properties a body has ~6, so that some of the valid bodies are also accepted and run (each field
# drawn has fair odds of a value the server refuses). (hypothesis's fixed_dictionaries(optional=)
# draws anything from 3 to 21 of 25, with no stated odds for any one.)
OPTIONAL_ODDS = 4
ABSENT = object()  # an optional property left out


class SchemaError(ValueError):
    """A schema construct this strategy does not know."""


def request_schemas(document: dict) -> dict[str, dict]:
    """The JSON request body's schema of each POST endpoint of an OpenAPI document, by path."""
    return {path: operations["post"]["requestBody"]["content"]["application/json"]["schema"]
            for path, operations in document["paths"].items() if "requestBody" in operations.get("post", {})}


def json_values() -> st.SearchStrategy:
    """Any JSON value: for `additionalProperties: true`, where the schema allows anything."""
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=MAX_ITEMS)
                        | st.dictionaries(st.text(), inner, max_size=MAX_ITEMS), max_leaves=MAX_LEAVES)


def from_schema(schema: dict, reached: dict[str, int] | None = None, path: str = "#",
                optional_odds: int = OPTIONAL_ODDS) -> st.SearchStrategy:
    """Values valid against `schema`, which is at `path` (for messages), each optional property
    drawn once in `optional_odds` values (1: always). If `reached` is given, it gets the path of
    every subschema a value can come from ("#/properties/stop/anyOf/1"), each counting the values
    drawn from it, for a test to check that none is left out."""
    return _Builder(reached, optional_odds).strategy(schema, path)


class _Builder:
    def __init__(self, reached: dict[str, int] | None, optional_odds: int):
        self.reached, self.optional_odds = reached, optional_odds

    def strategy(self, schema: dict, path: str) -> st.SearchStrategy:
        if not isinstance(schema, dict):
            raise SchemaError(f"{path}: a schema must be an object, not {schema!r}")
        keys = set(schema) - ANNOTATIONS
        if "anyOf" in keys:
            if keys != {"anyOf"}:
                raise SchemaError(f"{path}: anyOf together with {sorted(keys - {'anyOf'})} is not supported")
            strategy = st.one_of([self.strategy(s, f"{path}/anyOf/{i}") for i, s in enumerate(schema["anyOf"])])
        elif "enum" in keys or "const" in keys:
            if not keys <= {"enum", "type"} and not keys <= {"const", "type"}:
                raise SchemaError(f"{path}: {sorted(keys)}: enum or const goes with type alone here")
            strategy = st.sampled_from(schema["enum"]) if "enum" in keys else st.just(schema["const"])
        else:
            kind = schema.get("type")
            if not isinstance(kind, str) or kind not in KEYWORDS:
                raise SchemaError(f"{path}: type {kind!r} is not supported (known: {sorted(KEYWORDS)}, or anyOf, "
                                  f"enum or const instead); its keywords: {sorted(keys)}")
            unknown = keys - {"type"} - KEYWORDS[kind]
            if unknown:
                raise SchemaError(f"{path}: {sorted(unknown)} not supported for type {kind!r} "
                                  f"(known: {sorted(KEYWORDS[kind])})")
            strategy = getattr(self, kind)(schema, path)
        if self.reached is None:
            return strategy
        self.reached.setdefault(path, 0)

        def count(value):
            self.reached[path] += 1
            return value
        return strategy.map(count)

    def object(self, schema: dict, path: str) -> st.SearchStrategy:
        properties, required = schema.get("properties", {}), schema.get("required", [])
        if set(required) - set(properties):
            raise SchemaError(f"{path}: required {sorted(set(required) - set(properties))} not among the properties")
        members = {name: self.strategy(s, f"{path}/properties/{name}") for name, s in properties.items()}
        members = {name: s if name in required else self.optional(s) for name, s in members.items()}
        known = st.fixed_dictionaries(members).map(
            lambda drawn: {name: value for name, value in drawn.items() if value is not ABSENT})
        extra = schema.get("additionalProperties", True)  # (JSON Schema's default: any other member allowed)
        if extra is False:
            return known
        values = json_values() if extra is True else self.strategy(extra, f"{path}/additionalProperties")
        others = st.dictionaries(st.text().filter(lambda name: name not in properties), values, max_size=MAX_EXTRA)
        return st.tuples(known, others).map(lambda pair: {**pair[1], **pair[0]})

    def optional(self, strategy: st.SearchStrategy) -> st.SearchStrategy:
        """ABSENT, or once in optional_odds a value of `strategy`. (Not `st.just(ABSENT) | strategy`:
        hypothesis's one_of favours the richer branch, ~2 draws in 3 here.)"""
        if self.optional_odds == 1:
            return strategy
        return st.sampled_from([False] * (self.optional_odds - 1) + [True]).flatmap(
            lambda present: strategy if present else st.just(ABSENT))

    def array(self, schema: dict, path: str) -> st.SearchStrategy:
        if "items" not in schema:
            raise SchemaError(f"{path}: an array without items is not supported")
        least = schema.get("minItems", 0)
        return st.lists(self.strategy(schema["items"], f"{path}/items"), min_size=least, max_size=max(least, MAX_ITEMS))

    def string(self, schema: dict, path: str) -> st.SearchStrategy:
        return st.text(min_size=schema.get("minLength", 0))

    def integer(self, schema: dict, path: str) -> st.SearchStrategy:
        # (the OpenAPI document writes integer bounds as floats: "minimum": 1.0)
        low, high = schema.get("minimum"), schema.get("maximum")
        return st.integers(None if low is None else math.ceil(low), None if high is None else math.floor(high))

    def number(self, schema: dict, path: str) -> st.SearchStrategy:
        floats = st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False)
        return self.integer(schema, path) | floats  # (a JSON number may be written 3)

    def boolean(self, schema: dict, path: str) -> st.SearchStrategy:
        return st.booleans()

    def null(self, schema: dict, path: str) -> st.SearchStrategy:
        return st.none()
