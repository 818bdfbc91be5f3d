"""Structured output over HTTP: JSON schemas, regexes, choices, grammars and forced tool calls.

The real default model (SmolLM2-135M) answers through the official SDKs; its outputs must
parse and validate. Bad schemas, regexes and grammars are refused with a 400 naming the field,
checked on the engine double (it compiles grammars as the engine does). The tool-call grammar
of each syntax is checked against the tool-call parser without a model.
"""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import openai
import pytest
from serve_helpers import MODEL

from lodestar.engine.grammar import GrammarCompiler, GrammarSpec
from lodestar.serve import structured
from lodestar.serve.tool_parsers import parse_tool_calls

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                  "required": ["city"], "additionalProperties": False}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": WEATHER_PARAMS}},
              {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string", "maxLength": 16}},
                                                    "required": ["city"]}}}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}



@pytest.fixture(scope="module")
def fake_oai(fake_url):
    return openai.OpenAI(base_url=fake_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer)


# -- the real model, through the SDKs --------------------------------------------------------
def test_chat_json_schema_validates_and_counts_forced_tokens(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=40, **GREEDY, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    forced = r.usage.completion_tokens_details.forced_tokens
    assert 0 < forced < r.usage.completion_tokens        # '{"name": "' and '", "age": ' are forced


def test_chat_stream_guided_regex_survives_a_bad_grammar_mid_stream(oai, real_url):
    pattern = r"[A-Z][a-z]+( [a-z]+){2,4}\."
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me about cats."}],
                                         max_tokens=16, stream=True, stream_options={"include_usage": True},
                                         extra_body={"guided_regex": pattern, **GREEDY})
    chunks = [next(stream), next(stream)]          # the request is running in the engine
    bad = httpx.post(real_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": ASK_PERSON, "stream": True, "guided_grammar": "start: foo"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_grammar"
    chunks += list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert re.fullmatch(pattern, text), text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens_details.forced_tokens >= 0


def test_chat_guided_choice_and_metrics(oai, real_url):
    choices = ["The answer is yes", "The answer is no"]       # " answer is" is forced after the first token
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                    max_tokens=10, extra_body={"guided_choice": choices})
    assert r.choices[0].message.content in choices
    assert r.usage.completion_tokens_details.forced_tokens > 0
    text = httpx.get(real_url + "/metrics").text
    assert re.search(r'^lodestar_constrained_requests_total\{model=".*",kind="choice"\} [1-9]', text, re.M)
    assert re.search(r"^lodestar_forced_tokens_total\{.*\} [1-9]", text, re.M)
    assert float(re.search(r"^lodestar_grammar_mask_seconds_total\{.*\} ([0-9.]+)$", text, re.M).group(1)) > 0
    assert re.search(r"^lodestar_grammar_mask_rows_total\{.*\} [1-9]", text, re.M)


def test_completions_json_schema(oai):
    # (the SDK's completions.create has no response_format argument; the server reads it)
    legs = {"type": "object", "properties": {"legs": {"type": "integer", "minimum": 0, "maximum": 8}},
            "required": ["legs"], "additionalProperties": False}
    r = oai.completions.create(model=MODEL, prompt="A cat, as JSON:", max_tokens=12, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "cat", "schema": legs}}, **GREEDY})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), legs)
    assert r.usage.completion_tokens_details.forced_tokens > 0


def test_chat_named_tool_call_is_forced(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=40, **GREEDY, tools=CHAT_TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    assert r.usage.completion_tokens_details.forced_tokens > 0   # the whole envelope is forced


def test_responses_json_schema_and_required_tool(oai):
    r = oai.responses.create(model=MODEL, input="Describe a person as JSON.", max_output_tokens=40, **GREEDY,
                             text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                              "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.usage.output_tokens_details.forced_tokens > 0
    assert r.text.format.type == "json_schema"
    tools = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
    r = oai.responses.create(model=MODEL, input="What is the weather in Rome?", max_output_tokens=40, **GREEDY,
                             tools=tools, tool_choice="required", parallel_tool_calls=False)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(calls[0].arguments), tools[[t["name"] for t in tools].index(calls[0].name)]
                        ["parameters"])


def test_anthropic_output_format_and_forced_tool_use(ant):
    msg = ant.messages.create(model=MODEL, max_tokens=40, messages=ASK_PERSON, extra_body=GREEDY,
                              output_config={"format": {"type": "json_schema", "schema": PERSON}})
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), PERSON)
    tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_PARAMS}]
    with ant.messages.stream(model=MODEL, max_tokens=40, messages=ASK_WEATHER, tools=tools, extra_body=GREEDY,
                             tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_PARAMS)


# -- bad input: 400 naming the field (the engine double compiles as the engine does) ------------
@pytest.mark.parametrize("extra, param, reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "strin"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "guided_json",
     "does not exist"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "[a-z"}, "guided_regex", "unclosed character class"),
    ({"guided_grammar": "start: foo"}, "guided_grammar", "unknown name"),
    ({"guided_grammar": "root ::= [a-z"}, "guided_grammar", "GBNF"),
    ({"guided_regex": r"[^\s\S]"}, "guided_regex", ""),              # no token can start it
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "guided_regex and guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "response_format and"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
      "tool_choice": "required"}, "tools", "tool 'f'"),
])
def test_bad_constraints_are_400_naming_the_field(fake_oai, script, extra, param, reason):
    with pytest.raises(openai.BadRequestError) as e:
        fake_oai.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=5, stream=True,
                                         extra_body=extra)
    assert e.value.body["param"] == param
    assert reason in e.value.message


def test_bad_constraints_on_the_other_routes(fake_oai, fake_url, script):
    with pytest.raises(openai.BadRequestError) as e:
        fake_oai.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"guided_regex": "(a"})
    assert e.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as e:
        fake_oai.responses.create(model=MODEL, input="x", text={"format": {"type": "json_schema", "name": "x",
                                                                           "schema": {"type": "strin"}}})
    assert e.value.body["param"] == "text.format.schema" and "strin" in e.value.message
    ant = anthropic.Anthropic(base_url=fake_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=MODEL, max_tokens=5, messages=ASK_PERSON,
                            output_config={"format": {"type": "json_schema", "schema": {"type": "strin"}}})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "output_config.format.schema" in e.value.message and "strin" in e.value.message


def test_valid_constraints_reach_the_engine(fake_oai, fake_engine, script):
    fake_oai.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=5, extra_body={"guided_json": PERSON})
    spec = fake_engine.requests[-1][1].grammar
    assert (spec.kind, spec.value, spec.field) == ("json_schema", PERSON, "guided_json")
    fake_oai.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=5, tools=CHAT_TOOLS,
                                     tool_choice="auto")
    assert fake_engine.requests[-1][1].grammar is None           # auto without strict tools: free text


# -- the tool-call grammar of each syntax, read back by the tool-call parser -------------------
class _Template:
    """The default tokenizer with another chat template: the syntax is read from the template."""

    def __init__(self, tokenizer, template: str) -> None:
        self._tok, self.chat_template, self.has_chat_template = tokenizer, template, True

    def __getattr__(self, name):
        return getattr(self._tok, name)


def _accepts(compiler, tokenizer, lark: str, text: str) -> bool:
    matcher = compiler.matcher(GrammarSpec("grammar", lark, "tools"))
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


TIME_CALL = {"name": "get_time", "arguments": {"city": "Rome"}}
WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


def _hermes(*calls) -> str:
    return "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)


def _llama(*calls) -> str:
    return ";".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)


def _mistral_list(*calls) -> str:
    return "[TOOL_CALLS]" + json.dumps(list(calls))


def _mistral_name(*calls) -> str:
    return "".join(f"[TOOL_CALLS]{c['name']}[ARGS]{json.dumps(c['arguments'])}" for c in calls)


@pytest.mark.parametrize("template, write", [
    (None, _hermes),
    ("{% for t in tools %}{% endfor %}<|python_tag|>", _llama),
    ("{% for t in tools %}{% endfor %}[TOOL_CALLS]", _mistral_list),
    ("{% for t in tools %}{% endfor %}[TOOL_CALLS][ARGS]", _mistral_name),
])
def test_forced_tool_grammar_matches_the_parser(tokenizer, compiler, template, write):
    tok = tokenizer if template is None else _Template(tokenizer, template)
    names = {"get_weather", "get_time"}
    one = structured.tool_grammar(tok, CHAT_TOOLS, forced=True, parallel=False)
    many = structured.tool_grammar(tok, CHAT_TOOLS, forced=True, parallel=True)
    good, two = write(WEATHER_CALL), write(WEATHER_CALL, TIME_CALL)
    assert _accepts(compiler, tokenizer, one, good) and _accepts(compiler, tokenizer, many, two)
    assert not _accepts(compiler, tokenizer, one, two)                      # parallel_tool_calls false: one call
    assert not _accepts(compiler, tokenizer, one, write({"name": "get_weather", "arguments": {"city": "Lima"}}))
    assert not _accepts(compiler, tokenizer, one, write({"name": "get_time", "arguments": {"town": "Rome"}}))
    assert not _accepts(compiler, tokenizer, one, "Sure! " + good)          # forced: no text first
    content, calls = parse_tool_calls(two, names)
    assert content.strip() == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        (c["name"], c["arguments"]) for c in (WEATHER_CALL, TIME_CALL)]


def test_strict_tools_under_auto_allow_text_or_a_valid_call(tokenizer, compiler):
    strict = [{"type": "function", "function": {**CHAT_TOOLS[0]["function"], "strict": True}}, CHAT_TOOLS[1]]
    assert structured.tool_grammar(tokenizer, CHAT_TOOLS, forced=False, parallel=True) is None
    lark = structured.tool_grammar(tokenizer, strict, forced=False, parallel=True)
    assert _accepts(compiler, tokenizer, lark, "It is sunny.")
    assert _accepts(compiler, tokenizer, lark, "Let me check.\n" + _hermes(WEATHER_CALL))
    assert not _accepts(compiler, tokenizer, lark, _hermes({"name": "get_weather", "arguments": {"city": "Lima"}}))
    # a tool without strict: any JSON object as its arguments
    assert _accepts(compiler, tokenizer, lark, _hermes({"name": "get_time", "arguments": {"zone": 1}}))


def test_tool_schemas_with_refs_keep_their_meaning(tokenizer, compiler):
    params = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"],
              "$defs": {"Unit": {"enum": ["C", "F"]}}}
    tools = [{"type": "function", "function": {"name": "t", "parameters": params}}]
    lark = structured.tool_grammar(tokenizer, tools, forced=True, parallel=False)
    assert _accepts(compiler, tokenizer, lark, _hermes({"name": "t", "arguments": {"unit": "C"}}))
    assert not _accepts(compiler, tokenizer, lark, _hermes({"name": "t", "arguments": {"unit": "K"}}))


def test_constraint_after_an_open_reasoning_span(tokenizer, compiler):
    grammar = structured.output_grammar(tokenizer, GrammarSpec("json_schema", PERSON, "response_format"),
                                        in_reasoning=True)
    assert grammar.in_reasoning and grammar.spec.kind == "grammar"
    assert _accepts(compiler, tokenizer, grammar.spec.value, 'Hmm, a person.</think>\n\n{"name": "Ann", "age": 3}')
    assert not _accepts(compiler, tokenizer, grammar.spec.value, '{"name": "Ann", "age": 3}')
    regex = structured.output_grammar(tokenizer, GrammarSpec("regex", "a+", "guided_regex"), in_reasoning=True)
    assert regex.spec.kind == "regex" and not regex.in_reasoning      # applies from the first token


def test_response_formats_map_to_json_schemas():
    assert structured.response_format_spec({"type": "text"}) is None
    assert structured.response_format_spec({"type": "json_object"}) == GrammarSpec(
        "json_schema", {"type": "object"}, "response_format")
    assert structured.text_format_spec({"format": {"type": "json_schema", "name": "p", "schema": PERSON}}) == \
        GrammarSpec("json_schema", PERSON, "text.format.schema")
    assert structured.output_config_spec({"effort": "high"}) is None
    with pytest.raises(structured.APIError) as e:
        structured.response_format_spec({"type": "json_schema"})
    assert e.value.param == "response_format.json_schema"


def test_forced_tool_call_wins_over_a_format(tokenizer):
    warnings = SimpleNamespace(messages=[], add=lambda m: warnings.messages.append(m))
    grammar = structured.output_grammar(tokenizer, GrammarSpec("json_schema", PERSON, "response_format"), CHAT_TOOLS,
                                        tool_choice="required", warnings=warnings)
    assert grammar.spec.field == "tools" and "response_format ignored" in warnings.messages[0]
