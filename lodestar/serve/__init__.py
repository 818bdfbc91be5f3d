"""HTTP server: OpenAI (chat, completions, responses) and Anthropic (messages) APIs over one engine.

``lodestar serve`` (default http://127.0.0.1:8000) exposes:

- ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` (OpenAI),
- ``POST /v1/messages``, ``POST /v1/messages/count_tokens`` (Anthropic),
- ``GET /v1/models``, ``GET /v1/models/{id}`` (readable by both SDKs),
- ``POST /tokenize`` (vLLM's shape: the token ids of a text prompt or of chat messages),
- ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json``, ``GET /docs``,
- ``GET /`` (``static/index.html`` when present) and ``/static/*``.

Layout: one module per API translates its wire format to the neutral chat shape
(``chat_prompt``) and back; ``generation`` runs one engine request and yields neutral
deltas (reasoning, content, tool-call start/arguments/end, keep-alive); ``tool_parsers``
and ``reasoning`` read the model's own markup; ``structured`` turns output formats and
forced tool calls into grammars; ``sse``, ``errors``, ``auth`` and ``metrics`` are shared. No module here touches tensors.
``LocalServer`` (``local``) serves the app in-process on a Unix socket, for in-process clients such
as the coding agent.

Behaviour worth knowing:

- Requests name a served model (``--served-model-name``, repeatable); any other name is 404.
- Tools reach the chat template as ``tools=``; a template that ignores them (SmolLM2) gets a
  Hermes tools block in the system message instead. Hermes ``<tool_call>``, Llama-3 JSON /
  ``<|python_tag|>`` and Mistral ``[TOOL_CALLS]`` output becomes tool calls of the declared
  tools; anything malformed stays plain content.
- Structured output (``structured``): ``response_format`` and vLLM's ``guided_json`` /
  ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (chat, completions), ``text.format``
  (responses) and ``output_config.format`` (messages) become an engine grammar; so do forced
  tool calls (``tool_choice`` "required" or named, Anthropic any/tool; ``parallel_tool_calls``
  false = one call) and ``strict`` tools under auto, written in the model's own tool-call
  syntax. Grammars compile before generation starts: a bad one is a 400 naming the field.
- ``<think>`` spans become ``reasoning_content`` / ``thinking`` blocks / reasoning items;
  ``reasoning_effort``, ``reasoning.effort`` and Anthropic ``thinking`` set the template's
  ``enable_thinking``. ``thinking.budget_tokens`` is not enforced.
- A model without a chat template (a base model) is prompted with a plain
  ``User:`` / ``Assistant:`` transcript that stops at the next ``User:`` line.
- ``prompt + max_tokens`` beyond the context is a 400 carrying both counts; a full queue
  is 503 with ``Retry-After``; streams send ``: keep-alive`` comments while no token
  arrives; a client that disconnects aborts its request and frees its KV blocks.
- The server stores nothing: the Responses API refuses ``previous_response_id``.
- vLLM-style extras: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
  ``chat_template_kwargs`` and the ``guided_*`` fields on the OpenAI chat and completions routes.
"""
from lodestar.serve.app import build_app
from lodestar.serve.local import LocalServer
from lodestar.serve.state import ServeConfig

__all__ = ["build_app", "LocalServer", "ServeConfig"]
