"""Servers for the serve tests: the real default model once per session, and a scripted engine double.

Both run the real HTTP stack (uvicorn on a free loopback port in a background thread),
so the official SDKs talk to them exactly as they would to a deployed server.
"""
from __future__ import annotations

import anthropic
import openai
import pytest
from serve_helpers import MODEL, Script, ScriptedEngine, serve_in_thread

from lodestar.engine.async_engine import AsyncLLMEngine
from lodestar.engine.llm_engine import EngineConfig, LLMEngine
from lodestar.serve import ServeConfig, build_app


# -- the real model --------------------------------------------------------------------------
@pytest.fixture(scope="session")
def real_engine(smollm_path):
    from lodestar.engine.loader import load_model

    def build() -> LLMEngine:  # on the engine thread, as the server does
        return LLMEngine(load_model(str(smollm_path), progress=False),
                         EngineConfig(max_num_seqs=8, kv_tokens=8192, max_model_len=2048))

    aeng = AsyncLLMEngine(build, max_queued=64)
    yield aeng
    aeng.shutdown()


@pytest.fixture(scope="session")
def real_url(real_engine):
    app = build_app(real_engine, ServeConfig(model_names=(MODEL, "default"), keepalive_s=0.5))
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="session")
def tokenizer(real_engine):
    return real_engine.tokenizer


@pytest.fixture(scope="module")
def fake_engine(tokenizer):
    return ScriptedEngine(tokenizer)


@pytest.fixture(scope="module")
def fake_url(fake_engine):
    app = build_app(fake_engine, ServeConfig(model_names=(MODEL,), keepalive_s=0.1))
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture()
def script(fake_engine):
    """The double's script for one test (reset afterwards)."""
    fake_engine.script = Script()
    yield fake_engine.script
    fake_engine.script = Script()


@pytest.fixture(scope="module")
def oai(real_url):
    return openai.OpenAI(base_url=real_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ant(real_url):
    return anthropic.Anthropic(base_url=real_url, api_key="unused", max_retries=0)
