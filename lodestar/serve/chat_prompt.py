"""Render a conversation into prompt token ids with the model's chat template.

Every API converts its request into one neutral shape first, OpenAI chat messages:
``{"role", "content": str, "tool_calls": [...], "tool_call_id", "name", "reasoning_content"}``
and OpenAI function tools ``{"type": "function", "function": {"name", "description", "parameters"}}``.

- A template that reads ``tools`` gets them (and tool calls and results) natively.
- A template that ignores tools (SmolLM2's ChatML) gets a Hermes-style tools block in the
  system message, earlier tool calls written back as ``<tool_call>`` text and tool results as
  ``<tool_response>`` user turns, so the model can still call tools in a syntax the
  parser reads.
- A model without a template (a base model such as Gemma-3-270M) gets a plain
  ``User:`` / ``Assistant:`` transcript and a ``\\nUser:`` stop string, as ``lodestar chat``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import jinja2

from lodestar.serve.errors import APIError
from lodestar.serve.reasoning import prompt_opens_reasoning
from lodestar.tokenizer import TokenizerError

PLAIN_STOP = "\nUser:"
# Template arguments the server sets itself; a request's chat_template_kwargs cannot override them.
_RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenize",
                              "continue_final_message", "chat_template"})

HERMES_TOOLS_BLOCK = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass
class RenderedPrompt:
    ids: list[int]
    text: str
    stop: list[str] = field(default_factory=list)   # stop strings the prompt format needs
    in_reasoning: bool = False                       # the prompt leaves a <think> span open


def template_reads_tools(tokenizer) -> bool:
    return tokenizer.has_chat_template and "tools" in tokenizer.chat_template


def _arguments_object(arguments):
    """Templates expect tool-call arguments as a mapping; clients send a JSON string."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def _tool_call_text(call: dict) -> str:
    fn = call.get("function", {})
    args = _arguments_object(fn.get("arguments", {}))
    return "<tool_call>\n" + json.dumps({"name": fn.get("name", ""), "arguments": args}, ensure_ascii=False) \
        + "\n</tool_call>"


def _as_text_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Write tools, tool calls and tool results into plain message text (Hermes syntax)."""
    out: list[dict] = []
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            text = (m.get("content") or "").rstrip()
            calls = "\n".join(_tool_call_text(c) for c in m["tool_calls"])
            out.append({**{k: v for k, v in m.items() if k != "tool_calls"},
                        "content": f"{text}\n{calls}" if text else calls})
        elif role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        block = HERMES_TOOLS_BLOCK.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _native(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c.get("function", {}),
                                                  "arguments": _arguments_object(c.get("function", {})
                                                                                 .get("arguments", {}))}}
                               for c in m["tool_calls"]]
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


def _plain_transcript(messages: list[dict], continue_final: bool) -> str:
    lines = []
    for i, m in enumerate(messages):
        text = m.get("content") or ""
        if continue_final and i == len(messages) - 1:
            return "".join(lines) + f"Assistant: {text}"
        lines.append(f"{m['role'].capitalize()}: {text}\n")
    return "".join(lines) + "Assistant:"


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None, *,
                enable_thinking: bool | None = None, template_kwargs: dict | None = None,
                continue_final: bool = False, check_text: Callable[[str], None] | None = None) -> RenderedPrompt:
    """Prompt ids for ``messages`` (neutral shape, see the module doc); raises APIError(400) on bad input.

    ``check_text`` sees the rendered text before it is tokenized and may raise to refuse it.
    """
    if not messages:
        raise APIError(400, "messages must contain at least one message", param="messages")
    messages = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
    continue_final = continue_final and messages[-1]["role"] == "assistant" and bool(messages[-1].get("content"))
    if not tokenizer.has_chat_template:
        text = _plain_transcript(_as_text_tools(messages, tools), continue_final)
        if check_text is not None:
            check_text(text)
        return RenderedPrompt(tokenizer.encode(text), text, [PLAIN_STOP])
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_KWARGS}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    if template_reads_tools(tokenizer):
        chat, template_tools = _native(messages), tools or None
    else:
        chat, template_tools = _native(_as_text_tools(messages, tools)), None
    try:
        text = tokenizer.apply_chat_template(chat, tools=template_tools, add_generation_prompt=not continue_final,
                                             continue_final_message=continue_final, **kwargs)
    except (TokenizerError, TypeError, ValueError, jinja2.TemplateError) as e:
        raise APIError(400, f"The chat template cannot render these messages: {e}", param="messages") from None
    if check_text is not None:
        check_text(text)
    return RenderedPrompt(tokenizer.encode(text, add_special_tokens=False), text,
                          in_reasoning=prompt_opens_reasoning(text))
