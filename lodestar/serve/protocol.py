"""Request bodies of the four APIs as pydantic models (they also make the OpenAPI document).

Unknown fields are accepted and ignored, as the hosted APIs' clients send many; fields
the server reads are typed and range-checked, so a bad value is a 400 naming the field.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from lodestar.engine.sampling import MAX_STOP_CHARS

Bias = dict[str, Annotated[float, Field(ge=-100, le=100)]]
MAX_STOP_STRINGS = 16       # per request; the server may add the prompt format's own
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
Stop = Union[StopString, StopList, None]
ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


def speculate_field():
    """Lodestar's per-request opt-out of speculative decoding (strict: ``"yes"`` is a 400, not true)."""
    return Field(None, description="false: decode this request one token per step even when the server "
                                   "speculates (--spec); the output is the same either way")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- OpenAI chat completions ---------------------------------------------------------------
class ContentPart(_Open):
    type: str
    text: str | None = None


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Open):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Open):
    """A function tool; other types (``custom``, hosted tools) are dropped with a warning."""

    type: str = "function"
    function: FunctionDef | None = None


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Open):
    include_usage: bool = False


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = Field(None, description='{"name", "schema", "strict"} for type json_schema')


class SamplingFields(_Open):
    """Fields OpenAI chat and completions share."""

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1 = off")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: Bias | None = None
    seed: int | None = None
    stop: Stop = None
    n: int = Field(1, ge=1, le=8)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's structured-output extras; at most one constraint per request
    guided_json: dict[str, Any] | str | None = Field(None, description="a JSON schema, or its JSON text")
    guided_regex: str | None = Field(None, description="a regex the whole output matches")
    guided_choice: list[str] | None = Field(None, description="the output is one of these strings")
    guided_grammar: str | None = Field(None, description="a Lark (llguidance syntax) or GBNF grammar")
    speculate: StrictBool | None = speculate_field()


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Effort | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# -- OpenAI completions --------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=8)


# -- OpenAI responses ----------------------------------------------------------------------
class ReasoningConfig(_Open):
    effort: Effort | None = None
    summary: str | None = None


class ResponsesRequest(_Open):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    speculate: StrictBool | None = speculate_field()


# -- Anthropic messages --------------------------------------------------------------------
class AnthropicMessage(_Open):
    # system / developer messages (Claude Code sends them) are folded into the system prompt
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Open):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class MessagesCountRequest(_Open):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(MessagesCountRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: StopList | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    speculate: StrictBool | None = speculate_field()
