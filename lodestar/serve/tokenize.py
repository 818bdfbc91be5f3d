"""``POST /tokenize``: the token ids of a text prompt or of a chat request, in vLLM's shape.

A client counts a conversation before sending it (to compact a long history, say), and the
same client code works against vLLM. ``messages`` render through the chat route's own
conversion and template call (``openai_chat.render_request``), so ``count`` equals the
``usage.prompt_tokens`` of ``/v1/chat/completions`` for the same messages and tools. A prompt
longer than the context is counted, not refused: ``max_model_len`` in the answer is the limit.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from lodestar.serve.errors import APIError
from lodestar.serve.generation import RequestWarnings
from lodestar.serve.openai_chat import render_request
from lodestar.serve.protocol import ChatMessage, Effort, NamedToolChoice, ToolDef
from lodestar.serve.state import ServeState, get_state

router = APIRouter(tags=["Server"])


class TokenizeRequest(BaseModel):
    """vLLM's two tokenize bodies in one: a text ``prompt``, or chat ``messages`` (with ``tools``)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="a served model name; any other is 404")
    prompt: str | None = Field(None, description="text to tokenize as /v1/completions would")
    add_special_tokens: bool = Field(True, description="prompt only: add the BOS/EOS the model file asks for "
                                                       "(a chat template writes its own)")
    messages: list[ChatMessage] | None = Field(None, min_length=1,
                                               description="OpenAI chat messages, rendered as the chat route does")
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    reasoning_effort: Effort | None = None
    add_generation_prompt: bool = Field(True, description="end with the opening of the assistant's turn")
    chat_template_kwargs: dict[str, Any] | None = None


class _WithoutGenerationPrompt:
    """The engine's tokenizer, but its chat template leaves out the assistant turn's opening
    (``add_generation_prompt: false``), so the rest of the chat rendering stays the route's own."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs):
        return self._tokenizer.apply_chat_template(messages, tools, False, tokenize, **kwargs)


def token_ids(state: ServeState, body: TokenizeRequest, warnings: RequestWarnings) -> list[int]:
    """The ids the engine would be given for ``body``'s prompt or messages."""
    if body.model is not None:
        state.check_model(body.model)
    if body.prompt is not None and body.messages is not None:
        raise APIError(400, "Send either prompt or messages, not both.", param="messages")
    if body.prompt is not None:
        return state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    if body.messages is None:
        raise APIError(400, "Send prompt (a string) or messages (a list of chat messages) to tokenize.",
                       param="prompt")
    tokenizer = None
    if not body.add_generation_prompt:
        if state.tokenizer.has_chat_template:
            tokenizer = _WithoutGenerationPrompt(state.tokenizer)
        else:
            warnings.add("add_generation_prompt false ignored: this model has no chat template, and its plain "
                         "transcript always ends with the 'Assistant:' cue")
    prompt, _, _ = render_request(state, body, warnings, tokenizer=tokenizer, check_context=False)
    return prompt.ids


@router.post("/tokenize", summary="Count and list the prompt tokens of a text or chat request (vLLM)")
async def tokenize(body: TokenizeRequest, request: Request):
    state = get_state(request)
    warnings = RequestWarnings()
    ids = await run_in_threadpool(token_ids, state, body, warnings)   # a long text takes a while to tokenize
    return JSONResponse({"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids},
                        headers=warnings.headers())
