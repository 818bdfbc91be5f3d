"""The model manager over HTTP: listing, switching (waiting, draining, memory admission, failures),
unloading, adding and verifying; and a switch between the two real models.

Most tests switch between scripted engine doubles carrying the real models' tokenizers (a switch
then takes milliseconds); one switches real engines, as ``lodestar serve`` runs them.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import pytest
from serve_helpers import Script, ScriptedEngine, serve_in_thread

from lodestar.engine.async_engine import AsyncLLMEngine
from lodestar.engine.llm_engine import EngineConfig, LLMEngine
from lodestar.engine.sampling import SamplingParams
from lodestar.formats.catalog import GEMMA3_270M
from lodestar.formats.gguf import GGUFFile
from lodestar.formats.registry import ModelRegistry
from lodestar.serve import ServeConfig, build_app
from lodestar.serve.errors import APIError
from lodestar.serve.state import EngineSlot
from lodestar.serve.web import models_api
from lodestar.serve.web.models_api import EngineFactory, enable_model_switching
from lodestar.tokenizer import Tokenizer

SMOL_NAMES = ("smollm2-135m", "default")


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    g = GGUFFile(smollm_path)
    try:
        return Tokenizer.from_metadata(g.metadata)
    finally:
        g.close()


@pytest.fixture()
def double(tokenizer):
    """A scripted engine as the factory would build it for a model path (it knows its file; all
    speak SmolLM2's tokenizer, whose vocabulary builds in a fraction of Gemma's time)."""
    def make(path) -> ScriptedEngine:
        engine = ScriptedEngine(tokenizer)
        engine.engine = SimpleNamespace(loaded=SimpleNamespace(path=path, mode="packed", device="cpu",
                                                               close=lambda: None))
        return engine
    return make


@contextmanager
def switching_server(tmp_path, double, first, build=None, **factory_kw):
    """An app serving ``double(first)`` that switches with ``build`` (default: a double per path)."""
    built: list[str] = []

    def record(model: str):
        built.append(model)
        return (build or (lambda m: double(_path(m))))(model)

    app = build_app(double(first), ServeConfig(model_names=SMOL_NAMES, keepalive_s=0.1))
    manager = enable_model_switching(app, EngineFactory(record, **factory_kw), ModelRegistry(tmp_path / "models.json"))
    with serve_in_thread(app) as url:
        yield url, built, manager


def _path(model: str):
    from pathlib import Path
    return Path(model)


def chat(url: str, model: str = "smollm2-135m", **kw) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **kw})


def served_ids(url: str) -> list[str]:
    return [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]


def load(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/api/models/load", json={"model": model}, timeout=60)


# -- listing, adding, verifying -----------------------------------------------------------------
def test_lists_known_and_added_models_and_marks_the_loaded_one(tmp_path, double, smollm_path, gemma_path):
    with switching_server(tmp_path, double, smollm_path) as (url, _, _):
        body = httpx.get(url + "/api/models", timeout=30).json()
        rows = {r["name"]: r for r in body["data"]}
        smol, gemma = rows["smollm2-135m"], rows["gemma3-270m"]
        assert (smol["source"], smol["loaded"], smol["family"], smol["context"]) == ("known", True, "llama", 8192)
        assert "Q4_1" in smol["quant"] and smol["size_bytes"] == smollm_path.stat().st_size
        assert (gemma["loaded"], gemma["family"], gemma["path"]) == (False, "gemma3", str(gemma_path))
        assert body["loaded"]["name"] == "smollm2-135m" and body["loaded"]["path"] == str(smollm_path)

        r = httpx.post(url + "/api/models/add", json={"path": str(smollm_path), "name": "my-smol"}, timeout=60)
        assert r.status_code == 201, r.text
        assert r.json()["source"] == "added"
        assert r.json()["sha256"] == hashlib.sha256(smollm_path.read_bytes()).hexdigest()
        rows = {r["name"]: r for r in httpx.get(url + "/api/models", timeout=30).json()["data"]}
        assert rows["my-smol"]["path"] == str(smollm_path.resolve()) and rows["my-smol"]["family"] == "llama"

        r = httpx.post(url + "/api/models/add", json={"path": str(gemma_path), "name": "my-smol"}, timeout=60)
        assert r.status_code == 409 and "--name" in r.json()["error"]["message"]
        r = httpx.post(url + "/api/models/add", json={"path": str(tmp_path / "none.gguf")}, timeout=30)
        assert r.status_code == 400 and "no such file" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "path"


def test_verify_against_known_hash_added_hashes_and_a_manifest(tmp_path, double, smollm_path, gemma_path):
    with switching_server(tmp_path, double, smollm_path) as (url, _, manager):
        manager.registry.add(smollm_path, "my-smol")
        r = httpx.post(url + "/api/models/verify", json={"model": "gemma3-270m"}, timeout=60).json()
        assert (r["ok"], r["source"], r["sha256"], r["expected"]) == (True, "known", GEMMA3_270M.sha256,
                                                                      GEMMA3_270M.sha256)
        r = httpx.post(url + "/api/models/verify", json={"model": "my-smol"}, timeout=60).json()
        assert r["ok"] is True and r["source"] == "added"
        assert r["sha256"] == hashlib.sha256(smollm_path.read_bytes()).hexdigest()

        wrong = {"files": {"model.gguf": {"sha256": "0" * 64, "size": 1}}}
        r = httpx.post(url + "/api/models/verify", json={"model": "my-smol", "manifest": wrong}, timeout=60).json()
        assert r["ok"] is False and r["files"][0]["status"] == "changed" and r["expected"] == "0" * 64

        r = httpx.post(url + "/api/models/verify", json={"model": str(smollm_path), "manifest": {"files": 3}},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "manifest"
        r = httpx.post(url + "/api/models/verify", json={"model": "default"}, timeout=60).json()
        assert r["ok"] is None and r["files"][0]["status"] == "unchecked"


# -- switching ---------------------------------------------------------------------------------
def test_requests_during_a_switch_wait_and_run_on_the_new_model(tmp_path, double, smollm_path):
    building, release = threading.Event(), threading.Event()

    def slow_build(model: str):
        building.set()
        release.wait(10)
        return double(_path(model))

    with switching_server(tmp_path, double, smollm_path, build=slow_build) as (url, built, _):
        assert served_ids(url) == list(SMOL_NAMES)
        switch: list[httpx.Response] = []
        loader = threading.Thread(target=lambda: switch.append(load(url, "gemma3-270m")))
        loader.start()
        assert building.wait(10)
        held: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: held.append(chat(url, "gemma3-270m")))
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive()                                 # held while the new model loads
        listing = httpx.get(url + "/api/models", timeout=30).json()
        assert listing["switching"] == {"model": "gemma3-270m"} and listing["loaded"] is None
        r = load(url, "default")
        assert r.status_code == 409 and "already under way" in r.json()["error"]["message"]
        release.set()
        loader.join(10)
        waiter.join(10)
        assert switch[0].status_code == 200, switch[0].text
        assert switch[0].json()["loaded"]["name"] == "gemma3-270m" and switch[0].json()["changed"] is True
        assert held[0].status_code == 200, held[0].text               # ran on the new model
        assert served_ids(url) == ["gemma3-270m"]
        assert chat(url, "smollm2-135m").status_code == 404
        assert load(url, "gemma3-270m").json()["changed"] is False   # already loaded: nothing to do
        assert len(built) == 1


def test_a_stream_still_running_after_the_drain_timeout_ends_with_an_error(tmp_path, double, smollm_path):
    first = double(smollm_path)
    first.script = Script(pieces=("tok",) * 2000, step_delay=0.01)     # ~20 s if nothing stops it
    with switching_server(tmp_path, lambda p: first if p == smollm_path else double(p), smollm_path,
                          drain_timeout_s=0.3) as (url, _, _):
        lines: list[str] = []
        streaming = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=30, json={
                    "model": "smollm2-135m", "stream": True, "max_tokens": 2000,
                    "messages": [{"role": "user", "content": "hi"}]}) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if '"content"' in line:
                        streaming.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert streaming.wait(10)
        t0 = time.monotonic()
        r = load(url, "gemma3-270m")
        assert r.status_code == 200 and r.json()["ended_requests"] == 1
        assert time.monotonic() - t0 < 5
        reader.join(10)
        errors = [json.loads(l[6:]) for l in lines if l.startswith("data: {") and '"error"' in l]
        assert errors and "switched to the model gemma3-270m" in errors[0]["error"]["message"]
        assert first.running == 0                                          # its engine request was closed


def test_memory_admission_refuses_with_the_figures(tmp_path, double, smollm_path, gemma_path, monkeypatch):
    monkeypatch.setattr(models_api, "mem_available_bytes", lambda: 1 << 20)
    with switching_server(tmp_path, double, smollm_path, context=4096) as (url, built, _):
        r = load(url, "gemma3-270m")
        assert r.status_code == 409
        message = r.json()["error"]["message"]
        m = re.search(r"needs ([\d.]+) GiB \(([\d.]+) weights \+ ([\d.]+) KV\), ([\d.]+) GiB available", message)
        assert m, message
        total, weights, kv, available = map(float, m.groups())
        assert abs(weights - gemma_path.stat().st_size / 2**30) < 0.02         # packed weights ~ the file
        assert kv > 0 and abs(total - weights - kv) < 0.02
        assert available < 0.2 and "4096-token context" in message and "--ctx" in message
        assert built == []                                                    # nothing was loaded
        assert chat(url).status_code == 200                                   # the old model still serves


def test_a_failed_load_brings_the_previous_model_back(tmp_path, double, smollm_path, gemma_path):
    def build(model: str):
        if _path(model) == gemma_path:
            raise RuntimeError("simulated failure while loading")
        return double(_path(model))

    with switching_server(tmp_path, double, smollm_path, build=build) as (url, built, _):
        r = load(url, "gemma3-270m")
        assert r.status_code == 500
        message = r.json()["error"]["message"]
        assert "simulated failure" in message and "previous model smollm2-135m is loaded again" in message
        assert built == [str(gemma_path), str(smollm_path)]
        assert served_ids(url) == list(SMOL_NAMES) and chat(url).status_code == 200


@pytest.mark.parametrize("body,status,needle", [
    ({"model": "no-such-model"}, 404, "lodestar models add"),
    ({"model": "NOTES"}, 400, "not a GGUF file"),
    ({}, 400, "model"),
    ({"model": "default", "extra": 1}, 400, "extra"),
])
def test_bad_loads_are_refused_before_anything_changes(tmp_path, double, smollm_path, body, status, needle):
    notes = tmp_path / "notes.gguf"
    notes.write_text("not a model")
    if body.get("model") == "NOTES":
        body = {"model": str(notes)}
    with switching_server(tmp_path, double, smollm_path) as (url, built, _):
        r = httpx.post(url + "/api/models/load", json=body, timeout=30)
        assert r.status_code == status and needle in r.json()["error"]["message"]
        assert built == [] and chat(url).status_code == 200


def test_unload_makes_the_api_routes_503_until_the_next_load(tmp_path, double, smollm_path):
    with switching_server(tmp_path, double, smollm_path) as (url, _, _):
        assert httpx.post(url + "/api/models/unload", timeout=30).json()["loaded"] is None
        for r in (chat(url), httpx.get(url + "/v1/models", timeout=30),
                  httpx.post(url + "/v1/messages", timeout=30, json={
                      "model": "smollm2-135m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})):
            assert r.status_code == 503 and "POST /api/models/load" in r.text
        assert httpx.get(url + "/api/models", timeout=30).json()["loaded"] is None
        assert httpx.post(url + "/api/models/unload", timeout=30).status_code == 200     # already unloaded
        assert load(url, "default").status_code == 200
        assert served_ids(url) == list(SMOL_NAMES) and chat(url).status_code == 200


def test_a_server_without_a_factory_lists_but_does_not_switch(tmp_path, double, smollm_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    app = build_app(double(smollm_path), ServeConfig(model_names=SMOL_NAMES))
    with serve_in_thread(app) as url:
        r = load(url, "gemma3-270m")
        assert r.status_code == 409 and "cannot switch models" in r.json()["error"]["message"]
        assert httpx.post(url + "/api/models/unload", timeout=30).status_code == 409
        rows = {r["name"]: r for r in httpx.get(url + "/api/models", timeout=30).json()["data"]}
        assert rows["smollm2-135m"]["loaded"] is True
        assert chat(url).status_code == 200


def test_a_prompt_rendered_for_the_old_model_never_runs_on_the_new_one(double, smollm_path, gemma_path):
    async def scenario() -> None:
        slot = EngineSlot(double(smollm_path))
        assert slot.tokenizer is not None                   # the request renders its prompt ...
        slot.install(double(gemma_path))                    # ... a switch lands meanwhile
        with pytest.raises(APIError) as refused:
            async for _ in slot.generate([1, 2], SamplingParams(max_tokens=2)):
                pass
        assert refused.value.status == 503 and refused.value.code == "model_switched"
        assert slot.tokenizer is not None                   # rendered again, for the new model
        outputs = [o async for o in slot.generate([1, 2], SamplingParams(max_tokens=2))]
        assert outputs[-1].finished and slot.active == 0

    asyncio.run(scenario())


# -- real models ---------------------------------------------------------------------------------
def test_switches_between_the_real_models(tmp_path, smollm_path, gemma_path):
    def build(model: str) -> AsyncLLMEngine:
        return AsyncLLMEngine(lambda: LLMEngine(load_model_quietly(model), EngineConfig(
            max_num_seqs=4, kv_tokens=2048, max_model_len=1024)), max_queued=16)

    app = build_app(build(str(smollm_path)), ServeConfig(model_names=SMOL_NAMES))
    manager = enable_model_switching(app, EngineFactory(build, context=1024, kv_tokens=2048),
                                     ModelRegistry(tmp_path / "models.json"))
    try:
        with serve_in_thread(app) as url:
            r = load(url, "gemma3-270m")
            assert r.status_code == 200, r.text
            assert r.json()["loaded"]["family"] == "gemma3" and r.json()["loaded"]["context"] == 1024
            assert served_ids(url) == ["gemma3-270m"]
            r = chat(url, "gemma3-270m")
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            assert chat(url).status_code == 404
            rows = {r["name"]: r for r in httpx.get(url + "/api/models", timeout=30).json()["data"]}
            assert rows["gemma3-270m"]["loaded"] and not rows["smollm2-135m"]["loaded"]

            assert httpx.post(url + "/api/models/unload", timeout=60).status_code == 200
            r = chat(url, "gemma3-270m")
            assert r.status_code == 503 and "no model is loaded" in r.json()["error"]["message"].lower()

            assert load(url, "default").status_code == 200
            assert served_ids(url) == list(SMOL_NAMES)
            r = chat(url, "default", temperature=0)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    finally:
        current = manager.state.engine.current
        if current is not None:
            current.shutdown()


def load_model_quietly(model: str):
    from lodestar.engine.loader import load_model
    return load_model(model, progress=False)
