"""``lodestar bench structured``: its schemas are sound, its checks reject what they should, and a
tiny configuration runs end to end and writes the JSON the docs read."""
import json
import subprocess
import sys

import jsonschema
import pytest

from lodestar.bench.structured import check_json, check_tool_call, format_checker
from lodestar.bench.structured_schemas import (KEY_HEAVY, SCHEMAS, TOOLS, instance_text, tool_call_grammar,
                                               tool_call_schema)


def _keywords(schema) -> set[str]:
    found = set()
    if isinstance(schema, dict):
        found |= set(schema)
        if schema.get("additionalProperties") is False:
            found.add("closed")
        if isinstance(schema.get("type"), list) and "null" in schema["type"]:
            found.add("nullable")
        for v in schema.values():
            found |= _keywords(v)
    elif isinstance(schema, list):
        for v in schema:
            found |= _keywords(v)
    return found


def test_workload_covers_the_schema_features():
    assert len(SCHEMAS) >= 22 and 4 <= len(TOOLS) <= 6 and 3 <= len(KEY_HEAVY) <= 4
    assert len({s.name for s in SCHEMAS}) == len(SCHEMAS)
    used = _keywords([s.schema for s in SCHEMAS])
    for kw in ("properties", "minItems", "maxItems", "enum", "anyOf", "format", "pattern", "minimum", "maximum",
               "nullable", "closed", "const", "exclusiveMinimum"):
        assert kw in used, kw
    formats = {s for s in json.dumps([s.schema for s in SCHEMAS]).split('"') if s in
               ("date", "time", "date-time", "email", "uuid", "hostname", "ipv4")}
    assert len(formats) == 7
    for s in KEY_HEAVY:   # many long required keys: most of the object is forced
        keys = s.schema["required"]
        assert len(keys) >= 8 and min(len(k) for k in keys) >= 25


@pytest.mark.parametrize("case", SCHEMAS + KEY_HEAVY, ids=lambda c: c.name)
def test_every_instance_is_valid_under_its_schema(case):
    jsonschema.Draft202012Validator(case.schema, format_checker=format_checker()).validate(case.instance)
    assert check_json(instance_text(case), case.schema, format_checker()) == ("valid", "")
    assert instance_text(case) == json.dumps(json.loads(instance_text(case)))     # ", " and ": "


def test_tool_examples_are_valid_calls():
    checker = format_checker()
    for t in TOOLS:
        jsonschema.validate(t.example_arguments, t.parameters, format_checker=checker)
        call = json.dumps({"name": t.name, "arguments": t.example_arguments})
        assert check_tool_call(f"<tool_call>\n{call}\n</tool_call>", checker) == ("valid", "")
        assert t.openai()["function"]["parameters"] is t.parameters
    assert len(tool_call_schema(TOOLS)["anyOf"]) == len(TOOLS)


def test_checks_reject_what_they_should():
    checker = format_checker()
    weather = json.dumps({"name": "get_weather", "arguments": {"location": "Oslo", "unit": "kelvin"}})
    assert check_tool_call(f"<tool_call>\n{weather}\n</tool_call>", checker)[0] == "invalid"
    assert check_tool_call(weather, checker)[0] == "unparseable"                       # no tags
    unknown = json.dumps({"name": "rm_rf", "arguments": {}})
    assert check_tool_call(f"<tool_call>\n{unknown}\n</tool_call>", checker)[0] == "invalid"
    # formats jsonschema checks only with optional packages: RFC 3339 times, host names
    for fmt, good, bad in [("time", "10:30:00Z", "10:30:00"), ("date-time", "2024-01-01T10:00:00+02:00",
                                                                "2024-02-30T10:00:00Z"),
                           ("hostname", "api.example.com", "-bad-.example"), ("email", "a@b.co", "nope"),
                           ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123")]:
        schema = {"type": "string", "format": fmt}
        assert check_json(json.dumps(good), schema, checker)[0] == "valid", fmt
        assert check_json(json.dumps(bad), schema, checker)[0] == "invalid", fmt
    assert check_json('{"a": 1', {"type": "object"}, checker)[0] == "unparseable"


def test_instances_are_accepted_by_the_compiled_grammars(smollm_path):
    """The grammar the engine compiles lets each canonical instance through, token by token."""
    from lodestar.engine.grammar import GrammarCompiler, GrammarSpec
    from lodestar.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(smollm_path)
    compiler = GrammarCompiler(tok)

    def accepts(spec, text):
        m = compiler.matcher(spec)
        return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    for case in SCHEMAS + KEY_HEAVY:
        assert accepts(GrammarSpec("json_schema", case.schema), instance_text(case)), case.name
    tools = GrammarSpec("grammar", tool_call_grammar(TOOLS, tok))
    for t in TOOLS:
        call = json.dumps({"name": t.name, "arguments": t.example_arguments})
        assert accepts(tools, f"<tool_call>\n{call}\n</tool_call>"), t.name
    # the call's JSON has the engine's fixed separators: no free whitespace
    assert not accepts(tools, '<tool_call>\n{"name":"get_weather", "arguments": {"location": "Oslo"}}\n</tool_call>')


def test_bench_structured_end_to_end(smollm_path, tmp_path):
    out = tmp_path / "structured.json"
    cmd = [sys.executable, "-m", "lodestar.cli", "bench", "structured", "--threads", "1", "--schemas", "2",
           "--seeds", "1", "--tools", "1", "--tool-seeds", "0", "--max-tokens", "160", "--runs", "1",
           "--cost-tokens", "8", "--cost-batches", "1", "2", "--jump-schemas", "1", "--exact-targets", "2",
           "--exact-tokens", "10", "--exact-jump", "0", "--exact-modes", "packed", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for heading in ("validity:", "cost:", "jump:", "exact:"):
        assert heading in r.stdout
    doc = json.loads(out.read_text())
    assert doc["bench"] == "structured" and len(doc["model_sha256"]) == 64 and doc["torch"]
    assert doc["device"]["torch"] == doc["torch"] and doc["lodestar_device"] == "cpu"
    v = doc["parts"]["validity"]
    assert v["requests"] == 2 * 2 + 1 == len(v["cases"]) == sum(v["counts"].values())
    # a finished constrained output always parses and validates; only a cut-off one may not
    assert set(v["counts"]) <= {"valid", "truncated"}, v["failures"]
    c = doc["parts"]["cost"]
    for b in ("1", "2"):
        row = c["batches"][b]
        assert row["ratio"]["median"] > 0 and len(row["ratio"]["runs"]) == 1
        assert row["mask_us_per_token"]["median"] > 0
        assert row["wrong_length"] == []      # the grammar never ended before the token budget
    j = doc["parts"]["jump"]
    (name, row), = j["schemas"].items()
    assert name == KEY_HEAVY[0].name and row["valid"] == "valid" and row["forced"] > 0
    assert j["ratio"]["median"] > 0 and isinstance(j["identical_text"], bool)
    e = doc["parts"]["exact"]["modes"]["packed"]
    assert e["total"] == 2 and e["same"] == 2, e["checks"]     # batching does not change a request's tokens
