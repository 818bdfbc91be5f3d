"""Structured output over HTTP: what each API asks for, as one engine ``GrammarSpec``.

- Content constraints: OpenAI ``response_format`` (chat and completions), vLLM's extras
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, Responses
  ``text.format`` and Anthropic ``output_config.format``. At most one per request.
- Tool calls: a forced choice (OpenAI ``"required"`` or a named function, Anthropic ``any`` /
  ``tool``), or ``strict`` tools under ``auto``, become a Lark grammar in llguidance's syntax
  that writes the call envelope in the model's own tool-call syntax (the one
  ``tool_parsers`` reads back) with the arguments held to each tool's parameter schema.
- ``compile_grammar`` compiles on a worker thread before generation starts, so a bad schema,
  regex or grammar is a 400 naming the request field, never an error in the middle of a stream.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lodestar.engine.grammar import JSON_OPTIONS, GrammarError, GrammarSpec, bounded
from lodestar.serve.chat_prompt import template_reads_tools
from lodestar.serve.errors import APIError

# JSON inside a Lark grammar is written as ``json.dumps`` writes it, like a plain json_schema
# spec: no free whitespace for a small model to pad with.
JSON_FORMAT = JSON_OPTIONS
ANY_OBJECT = {"type": "object"}
GUIDED_KINDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                "guided_grammar": "grammar"}
THINK_END = "</think>"
TOOLS_FIELD = "tools"          # the field a tool-call grammar's errors name

# Tool-call syntaxes, as tool_parsers reads them.
HERMES, LLAMA, MISTRAL_LIST, MISTRAL_NAME = "hermes", "llama", "mistral_list", "mistral_name"
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
MISTRAL_START, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


@dataclass(frozen=True)
class OutputGrammar:
    """The grammar one request's output follows, and what the rest of the request needs to know."""

    spec: GrammarSpec
    in_reasoning: bool                                # the output still starts inside a reasoning span
    tool_schemas: tuple[tuple[str, Any], ...] = ()    # (tool, parameters) of a tool grammar, to name a bad one


# -- content constraints -------------------------------------------------------------------
def _schema_spec(schema: Any, field: str) -> GrammarSpec:
    if schema is None:
        schema = ANY_OBJECT              # a format without a schema: any JSON object
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"{field} must be a JSON schema object, got {type(schema).__name__}", param=field)
    return GrammarSpec("json_schema", schema, field)


def response_format_spec(fmt: dict | None, field: str = "response_format") -> GrammarSpec | None:
    """OpenAI chat / completions ``response_format``: text, json_object or json_schema."""
    if not fmt:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_schema", ANY_OBJECT, field)
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise APIError(400, f'{field}.json_schema is required with type json_schema: '
                                f'{{"name": "...", "schema": {{...}}}}', param=f"{field}.json_schema")
        return _schema_spec(inner.get("schema"), f"{field}.json_schema.schema")
    raise APIError(400, f"{field}.type must be text, json_object or json_schema, got {kind!r}", param=f"{field}.type")


def text_format_spec(text: dict | None) -> GrammarSpec | None:
    """OpenAI Responses ``text.format``: text, json_object or json_schema (name, schema, strict inline)."""
    fmt = (text or {}).get("format")
    if not fmt:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object with a type", param="text.format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_schema", ANY_OBJECT, "text.format")
    if kind == "json_schema":
        return _schema_spec(fmt.get("schema"), "text.format.schema")
    raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                   param="text.format.type")


def output_config_spec(config: dict | None) -> GrammarSpec | None:
    """Anthropic ``output_config.format``: ``{"type": "json_schema", "schema": {...}}``."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        kind = fmt.get("type") if isinstance(fmt, dict) else type(fmt).__name__
        raise APIError(400, f"output_config.format.type must be json_schema, got {kind!r}",
                       param="output_config.format.type")
    return _schema_spec(fmt.get("schema"), "output_config.format.schema")


def guided_specs(values: dict[str, Any]) -> list[GrammarSpec]:
    """vLLM's extra fields (``guided_json``: a schema or its JSON text, ``guided_regex``,
    ``guided_choice``: a list of strings, ``guided_grammar``: Lark or GBNF) that are set."""
    return [GrammarSpec(kind, values[name], name) for name, kind in GUIDED_KINDS.items()
            if values.get(name) is not None]


def openai_content_spec(body) -> GrammarSpec | None:
    """The output format of an OpenAI chat or completions request (``protocol.SamplingFields``):
    ``response_format`` or one of vLLM's ``guided_*`` fields; two of them are a 400."""
    fmt = body.response_format.model_dump(exclude_none=True) if body.response_format else None
    guided = guided_specs({name: getattr(body, name) for name in GUIDED_KINDS})
    return only_one([response_format_spec(fmt), *guided])


def _format_field(field: str) -> str:
    """The request field a content spec came from (``text.format`` for ``text.format.schema``)."""
    for suffix in (".json_schema.schema", ".schema"):
        if field.endswith(suffix):
            return field[:-len(suffix)]
    return field


def only_one(specs: list[GrammarSpec | None]) -> GrammarSpec | None:
    """The request's one content constraint; two are a 400 naming both fields."""
    given = [s for s in specs if s is not None]
    if len(given) > 1:
        a, b = (_format_field(s.field) for s in given[:2])
        raise APIError(400, f"{a} and {b} both constrain the output; send only one of them", param=b)
    return given[0] if given else None


# -- tool calls ----------------------------------------------------------------------------
def forced_choice(choice: Any) -> bool:
    """A tool_choice (in select_tools' terms) that requires a call: "required" or a named tool."""
    return choice == "required" or (choice is not None and not isinstance(choice, str))


def tool_syntax(tokenizer) -> str:
    """The syntax this model writes tool calls in: the one its template teaches, else the Hermes
    syntax chat_prompt teaches templates that do not read tools."""
    if not template_reads_tools(tokenizer):
        return HERMES
    template = tokenizer.chat_template
    if HERMES_START in template:
        return HERMES
    if MISTRAL_START in template:
        return MISTRAL_NAME if MISTRAL_ARGS in template else MISTRAL_LIST
    if "<|python_tag|>" in template:
        return LLAMA
    return HERMES


def _literal(tokenizer, text: str) -> str:
    """``text`` as a Lark expression: a special token by id (text cannot spell one), else a string."""
    tid = tokenizer.piece_to_id(text)
    if tid is not None and tokenizer.is_special(tid):
        return f"<[{tid}]>"
    return json.dumps(text)


def _regex_text(text: str) -> str:
    """``text`` matched literally inside a Lark ``/.../`` regex."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


def _local_ref(ref: str, prefix: str, moved: set[str]) -> str:
    """A ``$ref`` of one tool's schema, once its schema sits at ``#/$defs/<prefix>`` of a bigger one."""
    if not ref.startswith("#"):
        return ref                      # remote: llguidance refuses it, with its own message
    pointer = ref[1:]
    if pointer and not pointer.startswith("/"):
        return ref                      # an anchor ("#name"): left as it is
    for defs in ("/$defs/", "/definitions/"):
        if pointer.startswith(defs):
            name, _, rest = pointer[len(defs):].partition("/")
            if name in moved:
                return f"#/$defs/{prefix}__{name}" + (f"/{rest}" if rest else "")
    return f"#/$defs/{prefix}{pointer}"


def _rewrite_refs(value: Any, prefix: str, moved: set[str]) -> Any:
    if isinstance(value, dict):
        return {k: (_local_ref(v, prefix, moved) if k == "$ref" and isinstance(v, str)
                    else _rewrite_refs(v, prefix, moved)) for k, v in value.items()}
    if isinstance(value, list):
        return [_rewrite_refs(v, prefix, moved) for v in value]
    return value


def _hoist(schema: Any, prefix: str, defs: dict) -> None:
    """Put one tool's schema (and its own $defs) under ``defs`` with its refs rewritten, so several
    tools' schemas can live in one document without their ``#/...`` refs colliding."""
    if not isinstance(schema, dict):
        defs[prefix] = schema
        return
    own: dict = {}
    for key in ("definitions", "$defs"):
        if isinstance(schema.get(key), dict):
            own.update(schema[key])
    moved = set(own)
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions", "$schema", "$id")}
    defs[prefix] = _rewrite_refs(body, prefix, moved)
    for name, sub in own.items():
        defs[f"{prefix}__{name}"] = _rewrite_refs(sub, prefix, moved)


def _calls_schema(schemas: list[tuple[str, Any]], key: str, array: bool = False, single: bool = True) -> str:
    """``%json`` of one call object ``{"name": ..., key: {...}}`` (``anyOf`` over the tools, so each
    name pairs with its own argument schema), or of a list of them."""
    defs: dict = {}
    options = []
    for i, (name, params) in enumerate(schemas):
        _hoist(bounded(params), f"tool{i}", defs)
        options.append({"type": "object", "properties": {"name": {"const": name}, key: {"$ref": f"#/$defs/tool{i}"}},
                        "required": ["name", key], "additionalProperties": False})
    call = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {"type": "array", "items": call, "minItems": 1} if array else dict(call)
    if array and single:
        schema["maxItems"] = 1
    schema.update({"$defs": defs, "x-guidance": JSON_FORMAT})
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _args_schema(params: Any) -> str:
    schema = dict(bounded(params)) if isinstance(params, dict) else {"allOf": [params]}
    schema["x-guidance"] = JSON_FORMAT
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _tool_rules(tokenizer, syntax: str, schemas: list[tuple[str, Any]], parallel: bool
                ) -> tuple[str | None, str, str, list[str]]:
    """(the call's opening marker text or None, the Lark expression after it, between calls, rules)."""
    if syntax == LLAMA:
        return None, "call", '";"', [f"call: {_calls_schema(schemas, 'parameters')}"]
    if syntax == MISTRAL_LIST:                # one list holds every call
        return MISTRAL_START, "call_list", "", [f"call_list: {_calls_schema(schemas, 'arguments', True, not parallel)}"]
    if syntax == MISTRAL_NAME:
        args = _literal(tokenizer, MISTRAL_ARGS)
        rules = ["named_call: " + " | ".join(f"tool{i}" for i in range(len(schemas)))]
        for i, (name, params) in enumerate(schemas):
            rules += [f"tool{i}: {json.dumps(name)} {args} args{i}", f"args{i}: {_args_schema(params)}"]
        return MISTRAL_START, "named_call", "", rules
    end = _literal(tokenizer, HERMES_END)
    return HERMES_START, f'"\\n" call "\\n" {end}', '"\\n"', [f"call: {_calls_schema(schemas, 'arguments')}"]


def _reasoning_rules(tokenizer) -> list[str]:
    """An open reasoning span the output closes first: free text up to ``</think>``, then blanks."""
    end = _literal(tokenizer, THINK_END)
    if end.startswith("<["):                   # a special token: no text can contain it
        return [f"reasoning: REASONING? {end} BLANK?", r"REASONING: /(.|\n)+/", r"BLANK: /[ \t\r\n]+/"]
    return ["reasoning: think BLANK?", f"think[lazy]: /(.|\\n)*{_regex_text(THINK_END)}/", r"BLANK: /[ \t\r\n]+/"]


def tool_grammar(tokenizer, tools: list[dict], *, forced: bool, parallel: bool, in_reasoning: bool = False
                 ) -> str | None:
    """Lark text (llguidance syntax) for this request's tool calls, or None when nothing is constrained.

    ``tools`` are OpenAI function tools. forced: the output is one call (``parallel``: one or
    more) of these tools, arguments per each tool's schema. Otherwise, when some tools are
    ``strict``, the model may answer in text or call tools; a call it starts is held to the
    schema of a strict tool (any JSON object for the others)."""
    if not tools:
        return None
    strict = any(t["function"].get("strict") for t in tools)
    if not forced and not strict:
        return None
    schemas = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or ANY_OBJECT
        schemas.append((fn["name"], params if forced or fn.get("strict") else ANY_OBJECT))
    syntax = tool_syntax(tokenizer)
    marker, rest, sep, rules = _tool_rules(tokenizer, syntax, schemas, parallel)
    mark = _literal(tokenizer, marker) if marker else ""
    one = f"{mark} {rest}".strip()
    repeat = parallel and syntax != MISTRAL_LIST
    more = f" ({sep} {one})*" if repeat else ""
    if forced:
        answer = one + more
    elif marker is None:                       # a bare JSON call opens the output; text does not start with "{"
        answer = f"TEXT | {one}{more}"
        rules.append(r"TEXT: /[^{](.|\n)*/")
    elif mark.startswith("<["):                # special marker token: text cannot contain it
        answer = f"TEXT? ({one}{more})?"
        rules.append(r"TEXT: /(.|\n)+/")
    else:                                      # text up to the marker (lazily), or text without one
        lit = _regex_text(marker)
        answer = f"TEXT | lead {rest}{more}"
        rules += [f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{lit}(.|\\n)*/", f"lead[lazy]: /(.|\\n)*{lit}/"]
    head = "start: reasoning answer" if in_reasoning else "start: answer"
    extra = _reasoning_rules(tokenizer) if in_reasoning else []
    return "\n".join([head, f"answer: {answer}", *rules, *extra]) + "\n"


def _with_reasoning(tokenizer, spec: GrammarSpec) -> GrammarSpec | None:
    """``spec`` after an open reasoning span, or None where it cannot be wrapped (a regex or grammar);
    a malformed value comes back as it is, for the compiler to refuse with its own message."""
    if spec.kind == "json_schema":
        value = spec.value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return spec                   # compiling it reports the bad JSON
        if not isinstance(value, dict):
            return None
        body = "%json " + json.dumps({**value, "x-guidance": value.get("x-guidance", JSON_FORMAT)},
                                     ensure_ascii=False)
    elif spec.kind == "choice":
        if not isinstance(spec.value, list) or not spec.value or not all(isinstance(v, str) and v for v in spec.value):
            return spec                       # compiling it reports what is wrong
        body = " | ".join(json.dumps(v) for v in spec.value)
    else:
        return None
    rules = ["start: reasoning answer", f"answer: {body}", *_reasoning_rules(tokenizer)]
    return GrammarSpec("grammar", "\n".join(rules) + "\n", spec.field)


def output_grammar(tokenizer, content: GrammarSpec | None, tools: list[dict] | None = None, *,
                   tool_choice: Any = None, parallel: bool | None = None, in_reasoning: bool = False,
                   warnings=None) -> OutputGrammar | None:
    """The grammar for a request's output: its content constraint, or its tool calls.

    A forced tool call wins over a content format (there is no text for the format to apply
    to); strict tools under auto give way to one (their arguments are then not enforced).
    Both cases are reported in ``warnings``. With a reasoning span open in the prompt, the
    constraint applies after ``</think>`` for JSON, choices and tool calls; a regex or grammar
    applies from the first token (the output then has no reasoning)."""
    forced = forced_choice(tool_choice) and bool(tools)
    # A named tool is one call of it; "required" is one or more unless parallel_tool_calls is false.
    named = forced and tool_choice != "required"
    lark = tool_grammar(tokenizer, tools or [], forced=forced, parallel=parallel is not False and not named,
                        in_reasoning=in_reasoning)
    if lark is not None and content is not None:
        content_field = _format_field(content.field)
        if forced:
            _warn(warnings, f"{content_field} ignored: tool_choice forces a tool call, which has no text to format")
            content = None
        else:
            _warn(warnings, f"strict tool arguments are not enforced with {content_field}: the output follows "
                            f"{content_field}")
            lark = None
    if lark is not None:
        schemas = tuple((t["function"]["name"], t["function"].get("parameters") or ANY_OBJECT) for t in tools or ())
        return OutputGrammar(GrammarSpec("grammar", lark, TOOLS_FIELD), in_reasoning, schemas)
    if content is None:
        return None
    if in_reasoning:
        wrapped = _with_reasoning(tokenizer, content)
        if wrapped is not None:
            return OutputGrammar(wrapped, True)
    return OutputGrammar(content, False)


def _warn(warnings, message: str) -> None:
    if warnings is not None:
        warnings.add(message)


def grammar_label(grammar: OutputGrammar | None) -> str | None:
    """What a request's output was held to, for metrics: tool_call, or the spec's kind."""
    if grammar is None:
        return None
    return "tool_call" if grammar.tool_schemas else grammar.spec.kind


# -- compiling ------------------------------------------------------------------------------
def grammar_error(e: GrammarError) -> APIError:
    """A spec the grammar library refused: 400 naming the request field, with the library's reason."""
    return APIError(400, f"{e.field} cannot constrain the output: {e.reason}", param=e.field)


async def compile_grammar(state, grammar: OutputGrammar | None) -> None:
    """Compile the request's grammar on a worker thread before generation starts (the engine
    thread never waits on it); a bad spec is a 400 while the status line can still say so."""
    if grammar is None:
        return
    try:
        await state.engine.compile_grammar(grammar.spec)
    except GrammarError as e:
        if grammar.tool_schemas:
            await _blame_tool(state, grammar.tool_schemas)
        raise grammar_error(e) from None


async def _blame_tool(state, schemas: tuple[tuple[str, Any], ...]) -> None:
    """A tool grammar failed: compile each tool's schema alone to name the tool at fault."""
    for name, params in schemas:
        try:
            await state.engine.compile_grammar(GrammarSpec("json_schema", params, TOOLS_FIELD))
        except GrammarError as e:
            raise APIError(400, f"tools: the parameters schema of tool {name!r} cannot constrain its arguments: "
                                f"{e.reason}", param="tools") from None
