"""openapi_strategy.py, the fuzz's source of valid bodies: on the server's own OpenAPI request
schemas every value it draws is valid (checked by jsonschema, a separate implementation), every
property and every anyOf branch is drawn from, and a construct it does not know is an error."""
import json

import pytest
from hypothesis import HealthCheck, given, settings

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
jsonschema = pytest.importorskip("jsonschema")

from nanovllm.entrypoints.api_server import build_app  # noqa: E402
from openapi_strategy import SchemaError, from_schema, request_schemas  # noqa: E402

# Whole bodies drawn, as the fuzz draws them, to be checked valid.
BODIES = 200
# Values drawn from each subschema with parts, with every optional property present (so that
# those come up for certain), for each anyOf branch and each array's items to come up: a branch is
# one in 4 at worst (prompt's four forms). Counting parts over whole bodies would not do:
# hypothesis avoids repeating a part it has exhausted, such as a null branch, where little comes
# after it in the body (tool_choice's null branch came up in none of 300 bodies).
EXAMPLES_PER_PART = 50
NOT_SCHEMAS = {"default", "enum", "const"}  # keywords whose values are data, not subschemas


@pytest.fixture(scope="module")
def document():
    """The OpenAPI document the server answers at /openapi.json (FastAPI's app.openapi(); the
    engine is not needed to describe the endpoints)."""
    return build_app(None, "fuzzed", None, None, 1024).app.openapi()


def walk(schema, path="#", parent=None):
    """(path, node, its parent's path) for every dict in `schema`, at any depth, named as
    from_schema() names them: a walk of its own, so that a part the strategy skipped shows."""
    if isinstance(schema, dict):
        yield path, schema, parent
        for key, value in schema.items():
            if key == "properties":
                for name, sub in value.items():
                    yield from walk(sub, f"{path}/properties/{name}", path)
            elif key not in NOT_SCHEMAS:
                yield from walk(value, f"{path}/{key}", path)
    elif isinstance(schema, list):
        for i, item in enumerate(schema):
            yield from walk(item, f"{path}/{i}", parent)


def test_the_document_has_the_two_request_bodies(document):
    assert set(request_schemas(document)) == {"/v1/completions", "/v1/chat/completions"}


def draw(strategy, validator, examples: int) -> list:
    """Draw `examples` values (fewer where the strategy has fewer), each valid plain JSON."""
    values = []

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(value=strategy)
    def one(value):
        validator.validate(value)
        assert json.loads(json.dumps(value, allow_nan=False)) == value  # (plain JSON: what a client sends)
        values.append(value)
    one()
    return values


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_value_is_valid_and_every_part_of_the_schema_is_drawn(document, path):
    """Whole bodies, and values of each subschema with parts in turn: each is valid, every part
    of the schema has its place in the strategy, and each is drawn as part of its parent (each
    property, anyOf branch, array's items, extra members' schema)."""
    schema = request_schemas(document)[path]
    parents = {part_path: parent for part_path, _, parent in walk(schema)}
    reached: dict[str, int] = {}
    bodies = draw(from_schema(schema, reached), jsonschema.Draft202012Validator(schema), BODIES)
    assert not set(parents) - set(reached), f"parts with no place: {sorted(set(parents) - set(reached))}"
    optional = set(schema["properties"]) - set(schema["required"])
    share = sum(len(optional & set(body)) for body in bodies) / len(bodies) / len(optional)
    assert 0.15 < share < 0.4, share  # (about 1 in OPTIONAL_ODDS = 4)
    missed = []
    for part_path, part, _ in walk(schema):
        if part_path in parents.values():  # (a leaf has no parts: its values were checked with its parent's)
            reached = {}
            draw(from_schema(part, reached, part_path, optional_odds=1), jsonschema.Draft202012Validator(part),
                 EXAMPLES_PER_PART)
            missed += [child for child, parent in parents.items() if parent == part_path and not reached[child]]
    assert not missed, f"never drawn from their parent in {EXAMPLES_PER_PART} values: {missed}"
    assert len(parents) > 3 * len(schema["properties"])  # (the walk found the nesting)


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "properties": {"url": {"type": "string", "format": "uri"}}}, "#/properties/url: ['format']"),
    ({"type": "array", "items": {"type": "integer", "exclusiveMinimum": 0}}, "#/items: ['exclusiveMinimum']"),
    ({"type": "array", "items": {"type": "string"}, "maxItems": 2}, "#: ['maxItems']"),
    ({"oneOf": [{"type": "string"}, {"type": "null"}]}, "its keywords: ['oneOf']"),
    ({"type": ["string", "null"]}, "type ['string', 'null']"),
    ({"anyOf": [{"type": "string"}], "minLength": 1}, "anyOf together with ['minLength']"),
    ({"type": "string", "enum": ["a"], "minLength": 1}, "enum or const"),
    ({"type": "object", "properties": {}, "required": ["x"]}, "required ['x']"),
    ({"type": "array"}, "without items"),
    ({"$ref": "#/$defs/X"}, "its keywords: ['$ref']"),
])
def test_a_construct_it_does_not_know_is_an_error_naming_it(schema, words):
    with pytest.raises(SchemaError) as error:
        from_schema(schema)
    assert words in str(error.value)
