"""The agent's client against the real HTTP app over the default model, served in-process on
a Unix socket as `lodestar agent` does: streaming, exact counts, forced tool calls, cancel."""
from __future__ import annotations

import asyncio
import time

import pytest

from lodestar.agent.client import ChatClient, ModelError
from lodestar.agent.tools import tool_schemas, validate_call
from lodestar.engine.async_engine import AsyncLLMEngine
from lodestar.engine.llm_engine import EngineConfig, LLMEngine
from lodestar.serve import LocalServer, ServeConfig, build_app


@pytest.fixture(scope="module")
def served(smollm_path):
    from lodestar.engine.loader import load_model
    aeng = AsyncLLMEngine(lambda: LLMEngine(load_model(str(smollm_path), progress=False),
                                            EngineConfig(max_num_seqs=4, kv_tokens=8192, max_model_len=4096)))
    server = LocalServer(build_app(aeng, ServeConfig(model_names=("smol",)))).start()
    yield aeng, server
    server.stop()
    aeng.shutdown()


def run(server, fn):
    async def go():
        client = ChatClient(server.base_url, transport=server.client_transport())
        try:
            return await fn(client)
        finally:
            await client.aclose()
    return asyncio.run(go())


def test_streams_with_exact_usage(served):
    _, server = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    deltas = []

    async def fn(client):
        n = await client.count_tokens(messages)
        c = await client.complete(messages, max_tokens=8, temperature=0.0,
                                  on_delta=lambda k, t: deltas.append((k, t)))
        return n, c, await client.context_length(), client.model

    n, c, ctx, model = run(server, fn)
    assert model == "smol" and ctx == 4096
    assert c.prompt_tokens == n > 0 and c.completion_tokens >= 1 and c.finish_reason in ("stop", "length")
    assert "".join(t for k, t in deltas if k == "content") == c.content and c.ttft_s is not None


def test_forced_tool_call_arrives_as_a_valid_call(served):
    _, server = served
    messages = [{"role": "user", "content": "Show me the file app.py"}]

    async def fn(client):
        return await client.complete(messages, tool_schemas(["read", "list"]), tool_choice="required",
                                     parallel_tool_calls=False, max_tokens=256, temperature=0.0)

    c = run(server, fn)
    assert c.finish_reason == "tool_calls" and len(c.tool_calls) >= 1, (c.content, c.tool_calls)
    checked = validate_call(c.tool_calls[0].name, c.tool_calls[0].arguments)
    assert not hasattr(checked, "ok"), checked              # (Tool, args): it passes the tool's schema
    assert c.tool_calls[0].id


def test_cancelling_a_call_aborts_the_request(served):
    aeng, server = served
    started = asyncio.Event()

    async def fn(client):
        task = asyncio.ensure_future(client.complete([{"role": "user", "content": "Count to a thousand."}],
                                                     max_tokens=2000, on_delta=lambda k, t: started.set()))
        await asyncio.wait_for(started.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(server, fn)
    deadline = time.monotonic() + 10
    while aeng.stats().get("running", 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aeng.stats().get("running", 0) == 0


def test_http_errors_are_model_errors(served):
    _, server = served

    async def fn(client):
        client.model = "no-such-model"
        with pytest.raises(ModelError, match="404"):
            await client.complete([{"role": "user", "content": "hi"}], max_tokens=4)

    run(server, fn)


def test_unreachable_server_is_a_model_error():
    async def fn():
        client = ChatClient("http://127.0.0.1:9/v1", model="m")
        try:
            with pytest.raises(ModelError, match="127.0.0.1:9"):
                await client.complete([{"role": "user", "content": "hi"}])
        finally:
            await client.aclose()
    asyncio.run(fn())
