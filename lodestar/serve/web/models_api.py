"""The model manager: list models, switch the served one, add models by path, verify their files.

- ``GET /api/models``: known, added and local models, and the one loaded.
- ``POST /api/models/load`` ``{"model": NAME|PATH}``: memory admission first (weights + KV
  for the configured context against MemAvailable, or free GPU memory, counting the current
  model's memory as freed), then the switch: requests that use the engine wait, running ones
  get ``drain_timeout_s`` to finish and are then ended with an error, the old engine shuts
  down, the new one starts. A load that fails after the old model went brings the old one back.
- ``POST /api/models/unload``: the OpenAI and Anthropic routes answer 503 until the next load.
- ``POST /api/models/add`` ``{"path", "name"?}``, ``POST /api/models/verify`` ``{"model", "manifest"?}``.

Switching needs an ``EngineFactory`` (``lodestar serve`` gives one, built from its flags):
``enable_model_switching(app, factory)`` puts an ``EngineSlot`` in ``state.engine`` and a
middleware that holds engine requests while a switch is under way.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from lodestar.formats.catalog import KNOWN_MODELS, ModelNotFoundError, known_model_path, local_model_files
from lodestar.formats.registry import (CheckpointInfo, DescriptionCache, Located, ManifestError, ModelRegistry,
                                       RegistryConflictError, RegistryError, cached_digest, expected_manifest, locate,
                                       parse_manifest, verify)
from lodestar.serve.errors import APIError
from lodestar.serve.state import EngineSlot, ServeState, get_state

router = APIRouter(prefix="/api/models", tags=["Web app"])

GIB = 1 << 30
ENGINE_PATHS = ("/v1/", "/tokenize")        # routes that run the engine, held during a switch
ENGINE_POST_PATHS = ("/api/conversations/",)


# -- how the server builds engines ------------------------------------------------------------
def release_engine(engine: object) -> None:
    """Shut an engine down and free its model (tensor-parallel workers included)."""
    shutdown = getattr(engine, "shutdown", None)
    if callable(shutdown):
        shutdown()
    loaded = getattr(getattr(engine, "engine", None), "loaded", None)
    if loaded is not None:
        loaded.close()
    gc.collect()          # weights held by reference cycles go now, before the next model loads


@dataclass
class EngineFactory:
    """How the server builds an engine for another model with its own settings; calling it builds one."""

    build: Callable[[str], object]      # model path -> a running AsyncLLMEngine (blocks; runs on a worker thread)
    mode: str = "packed"                # --dtype: sizes the weights in the memory estimate
    device: str = "cpu"                 # cpu: RAM must hold the model; cuda: GPU memory must
    context: int | None = None          # --ctx (None: the model's own)
    kv_tokens: int = 16384              # the KV pool's capacity, which caps the context
    drain_timeout_s: float = 30.0       # running requests get this long to finish before a switch ends them
    sampling_defaults: Callable[[object], dict] | None = None   # engine -> request defaults (None: keep them)
    release: Callable[[object], None] = release_engine

    def __call__(self, model: str) -> object:
        return self.build(model)


# -- memory admission -------------------------------------------------------------------------
def mem_available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_free_bytes(device: str) -> int | None:
    """Free memory of a CUDA device (None without one)."""
    import torch
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info(torch.device(device))[0])


def available_bytes(device: str) -> tuple[int | None, str]:
    """(bytes available, where) for models placed on ``device``."""
    if device.startswith("cuda"):
        return gpu_free_bytes(device), f"free on {device}"
    return mem_available_bytes(), "MemAvailable"


@dataclass(frozen=True)
class MemoryNeed:
    weights: int
    kv: int
    context: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


def memory_need(info: CheckpointInfo, factory: EngineFactory) -> MemoryNeed:
    """Weights in the server's weight mode plus the KV cache for its context (fp32 KV on the CPU,
    bf16 on a GPU unless the weights are fp32, as the engine allocates it)."""
    context = min(factory.context or info.context, info.context, factory.kv_tokens)
    element = 2 if factory.device.startswith("cuda") and factory.mode != "fp32" else 4
    return MemoryNeed(info.weights_bytes(factory.mode), info.kv_bytes(context, element), context)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}" if n >= GIB else f"{n / GIB:.2f}"


def admission_error(name: str, need: MemoryNeed, available: int, freed: int, where: str) -> APIError:
    counted = f" (counting the {_gib(freed)} GiB the current model frees)" if freed else ""
    return APIError(409, f"Cannot load {name}: it needs {_gib(need.total)} GiB ({_gib(need.weights)} weights + "
                         f"{_gib(need.kv)} KV), {_gib(available)} GiB available ({where}){counted}. The KV figure is "
                         f"for a {need.context}-token context. Free memory, choose a smaller model or quantization, "
                         "or restart the server with a smaller --ctx.", param="model", code="insufficient_memory")


# -- checks -----------------------------------------------------------------------------------
def check_loadable(path: Path, tokenizer: bool = True) -> None:
    """The engine's own checks of a checkpoint without loading weights: a supported architecture,
    the tensors it expects, and (``tokenizer``) a tokenizer that reads -- seconds for a large
    vocabulary, which loading the model builds anyway. Raises with the file and the fix."""
    from lodestar.engine.loader import gguf_tokenizer, open_checkpoint, validate_gguf
    from lodestar.formats.gguf import GGUFFile
    from lodestar.formats.safetensors import HFCheckpointError
    from lodestar.models import CheckpointError, UnsupportedArchitectureError, validate
    path, source = open_checkpoint(str(path))
    try:
        if isinstance(source, GGUFFile):
            validate_gguf(path, source)
            if tokenizer:
                gguf_tokenizer(path, source)
        else:
            try:
                validate(source.config, source.tensors)
            except (CheckpointError, UnsupportedArchitectureError) as e:
                raise HFCheckpointError(f"{path}: {e}") from None
            if tokenizer:
                source.tokenizer()
    finally:
        if isinstance(source, GGUFFile):
            source.close()


def _bad_model(e: Exception, param: str) -> APIError:
    if isinstance(e, ModelNotFoundError):
        return APIError(404 if param == "model" else 400, str(e), param=param, code="model_not_found")
    if isinstance(e, RegistryConflictError):
        return APIError(409, str(e), param="name")
    return APIError(400, str(e), param=param)


# Errors of reading a checkpoint or the registry: bad input, reported as 4xx with their message.
def _input_errors() -> tuple[type[BaseException], ...]:
    from lodestar.formats.gguf import GGUFError
    from lodestar.tokenizer import TokenizerError
    return (ModelNotFoundError, RegistryError, ManifestError, GGUFError, TokenizerError, ValueError, OSError)


# -- the manager ------------------------------------------------------------------------------
class ModelManager:
    """One per app (``app.state.models``): what is loaded, and the switch between models."""

    def __init__(self, state: ServeState, factory: EngineFactory | None = None,
                 registry: ModelRegistry | None = None) -> None:
        self.state, self.factory = state, factory
        self.registry = registry or ModelRegistry()
        self.descriptions = DescriptionCache()
        self.switching_to: str | None = None
        loaded = getattr(getattr(self._current(), "engine", None), "loaded", None)
        path = getattr(loaded, "path", None)
        self.loaded_path: Path | None = Path(path) if path is not None else None

    def _current(self) -> object | None:
        engine = self.state.engine
        return engine.current if isinstance(engine, EngineSlot) else engine

    def _slot(self) -> EngineSlot:
        engine = self.state.engine
        if self.factory is None or not isinstance(engine, EngineSlot):
            raise APIError(409, "This server cannot switch models: it was not started by `lodestar serve` (its app "
                                "has no engine factory). Restart it with `lodestar serve --model NAME`.",
                           code="switching_unavailable")
        return engine

    # -- reading ----------------------------------------------------------------------------
    def loaded_info(self) -> dict | None:
        engine = self._current()
        if engine is None:
            return None
        loaded = getattr(getattr(engine, "engine", None), "loaded", None)
        info = {"name": self.state.model_id, "names": list(self.state.config.model_names),
                "path": str(self.loaded_path) if self.loaded_path else None, "family": None,
                "mode": getattr(loaded, "mode", None), "device": getattr(loaded, "device", None),
                "context": getattr(engine, "max_model_len", None)}
        if self.loaded_path is not None:
            try:
                info["family"] = self.descriptions.describe(self.loaded_path).family
            except _input_errors():     # the file changed under the running model: the rest still holds
                info["family"] = None
        return info

    def _row(self, name: str, path: Path | None, source: str, error: str | None = None) -> dict:
        row = {"name": name, "path": str(path) if path is not None else None, "family": None, "size_bytes": None,
               "quant": None, "sha256": None, "context": None, "loaded": False, "source": source, "error": error}
        if path is None or error is not None:
            return row
        try:
            info = self.descriptions.describe(path)
            row.update(family=info.family, size_bytes=info.size_bytes, quant=info.quant, context=info.context,
                       sha256=cached_digest(path))
        except Exception as e:  # noqa: BLE001 -- a broken file is listed with its error, not fatal to the list
            row["error"] = str(e)
        current = self.loaded_path if self._current() is not None else None
        row["loaded"] = current is not None and path.resolve() == current.resolve()
        return row

    def listing(self) -> dict:
        rows, seen = [], set()
        for name in KNOWN_MODELS:
            try:
                path = known_model_path(name)
            except ModelNotFoundError as e:
                rows.append(self._row(name, None, "known", str(e)))
                continue
            seen.add(path.resolve())
            rows.append(self._row(name, path, "known"))
        for m in self.registry.entries():
            seen.add(m.path)
            missing = None if m.path.exists() else (f"{m.path} no longer exists: add it again or remove it "
                                                    f"(`lodestar models rm {m.name}`)")
            rows.append(self._row(m.name, m.path, "added", missing))
        for path in local_model_files():
            if path.resolve() not in seen:
                rows.append(self._row(path.stem, path, "local"))
        switching = {"model": self.switching_to} if self.switching_to is not None else None
        return {"loaded": self.loaded_info(), "switching": switching, "data": rows}

    def _prepare(self, spec: str) -> tuple[Located, CheckpointInfo]:
        try:
            located = locate(spec, self.registry)
            info = self.descriptions.describe(located.path)
            check_loadable(located.path, tokenizer=False)     # before the old model goes; the load reads it
        except _input_errors() as e:
            raise _bad_model(e, "model") from None
        return located, info

    # -- switching --------------------------------------------------------------------------
    async def load(self, spec: str) -> dict:
        slot = self._slot()
        located, info = await asyncio.to_thread(self._prepare, spec)
        current = self._current()
        if current is not None and self.loaded_path is not None and located.path.resolve() == self.loaded_path.resolve():
            return {"loaded": self.loaded_info(), "changed": False, "ended_requests": 0}
        need = memory_need(info, self.factory)
        available, where = await asyncio.to_thread(available_bytes, self.factory.device)
        freed = 0
        if current is not None and self.loaded_path is not None:
            try:
                freed = memory_need(self.descriptions.describe(self.loaded_path), self.factory).total
            except _input_errors():     # the running model's file changed: count nothing as freed
                freed = 0
        if available is not None and need.total > available + freed:
            raise admission_error(located.name, need, available, freed, where)
        if not slot.begin_switch():
            raise self._busy()
        # Shielded: a client that goes away must not leave the server between two models.
        return await asyncio.shield(asyncio.ensure_future(self._switch(slot, located, spec)))

    def _busy(self) -> APIError:
        doing = f"loading {self.switching_to}" if self.switching_to else "unloading"
        return APIError(409, f"A model switch is already under way ({doing}); wait for it to finish "
                             "(GET /api/models shows it) and try again.", code="switch_in_progress")

    async def _switch(self, slot: EngineSlot, located: Located, spec: str) -> dict:
        factory, config = self.factory, self.state.config
        self.switching_to = located.name
        try:
            ended = await slot.drain(factory.drain_timeout_s, f"the server switched to the model {located.name} "
                                     "(POST /api/models/load) before this request finished; send it again")
            before = (self.loaded_path, config.model_names, dict(config.sampling_defaults))
            old = slot.install(None)
            self.loaded_path = None
            if old is not None:
                await asyncio.to_thread(factory.release, old)
            try:
                engine = await asyncio.to_thread(factory.build, str(located.path))
            except Exception as e:  # noqa: BLE001 -- whatever stopped the load, bring the old model back
                restored = before[0] is not None and await self._restore(slot, *before)
                again = (f"The previous model {config.model_names[0]} is loaded again." if restored else
                         'No model is loaded now; load one with POST /api/models/load {"model": NAME}.')
                status = 400 if isinstance(e, _input_errors()) else 500
                raise APIError(status, f"Could not load {located.name}: {e}. {again}", param="model",
                               code="model_load_failed") from None
            names = (located.name, spec) if located.source == "known" else (located.name,)
            self._install(slot, engine, located.path, tuple(dict.fromkeys(names)))
        finally:
            self.switching_to = None
            slot.end_switch()
        return {"loaded": self.loaded_info(), "changed": True, "ended_requests": ended}

    def _install(self, slot: EngineSlot, engine: object, path: Path, names: tuple[str, ...],
                 sampling: dict | None = None) -> None:
        config = self.state.config
        if sampling is None and self.factory.sampling_defaults is not None:
            sampling = self.factory.sampling_defaults(engine)
        if sampling is not None:
            config.sampling_defaults = sampling
        config.model_names = names
        self.loaded_path = path
        slot.install(engine)

    async def _restore(self, slot: EngineSlot, path: Path, names: tuple[str, ...], sampling: dict) -> bool:
        try:
            engine = await asyncio.to_thread(self.factory.build, str(path))
        except Exception:  # noqa: BLE001 -- reported as "no model is loaded now"
            return False
        self._install(slot, engine, path, names, sampling)
        return True

    async def unload(self) -> dict:
        slot = self._slot()
        if not slot.begin_switch():
            raise self._busy()
        try:
            ended = await slot.drain(self.factory.drain_timeout_s, "the server unloaded its model "
                                     "(POST /api/models/unload) before this request finished")
            old = slot.install(None)
            self.loaded_path = None
            if old is not None:
                await asyncio.to_thread(self.factory.release, old)
        finally:
            slot.end_switch()
        return {"loaded": None, "ended_requests": ended}

    # -- adding and verifying ---------------------------------------------------------------
    def add(self, path: str, name: str | None) -> dict:
        try:
            entry = self.registry.add(path, name, check=check_loadable)
        except _input_errors() as e:
            raise _bad_model(e, "path") from None
        return self._row(entry.name, entry.path, "added")

    def verify(self, spec: str, manifest: dict | None) -> dict:
        try:
            located = locate(spec, self.registry)
            if manifest is not None:
                expected, source = parse_manifest(manifest, "manifest"), "manifest"
            else:
                expected, source = expected_manifest(located, self.registry)
            result = verify(located.path, expected, source)
        except ManifestError as e:
            raise APIError(400, str(e), param="manifest") from None
        except _input_errors() as e:
            raise _bad_model(e, "model") from None
        return {"model": located.name, "path": str(located.path), "ok": result.ok, "sha256": result.sha256,
                "expected": result.expected, "source": result.source,
                "files": [dataclasses.asdict(f) for f in result.files]}


# -- the switch gate and the app hook ---------------------------------------------------------
class SwitchGate:
    """Holds requests that would use the engine while a model switch is under way, so they run on
    the new model rather than fail."""

    def __init__(self, app, slot: EngineSlot) -> None:
        self.app, self.slot = app, slot

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.slot.switching and _uses_engine(scope):
            await self.slot.wait_ready()
        await self.app(scope, receive, send)


def _uses_engine(scope) -> bool:
    path = scope.get("path", "")
    return path.startswith(ENGINE_PATHS) or (scope.get("method") == "POST" and path.startswith(ENGINE_POST_PATHS))


def enable_model_switching(app, factory: EngineFactory | Callable[[str], object],
                           registry: ModelRegistry | None = None) -> ModelManager:
    """Let ``POST /api/models/load|unload`` replace the app's engine, building new ones with
    ``factory``. Call before the app starts serving."""
    if not isinstance(factory, EngineFactory):
        factory = EngineFactory(factory)
    state = app.state.serve
    if not isinstance(state.engine, EngineSlot):
        state.engine = EngineSlot(state.engine)
    manager = ModelManager(state, factory, registry)
    app.state.models = manager
    app.add_middleware(SwitchGate, slot=state.engine)
    return manager


def _manager(request: Request) -> ModelManager:
    manager = getattr(request.app.state, "models", None)
    if manager is None:                 # an app that cannot switch still lists, adds and verifies
        manager = request.app.state.models = ModelManager(get_state(request))
    return manager


# -- routes -----------------------------------------------------------------------------------
class LoadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=4096, description="a model name or a GGUF file / folder path")


class AddBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1, max_length=4096, description="a GGUF file or a Hugging Face folder")
    name: str | None = Field(default=None, max_length=80, description="default: the file stem or folder name")


class VerifyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=4096)
    manifest: dict | None = Field(default=None, description='{"files": {"relative/path": {"sha256", "size"}}}')


@router.get("", summary="Known, added and local models, and the loaded one")
async def list_models(request: Request) -> dict:
    return await asyncio.to_thread(_manager(request).listing)


@router.post("/load", summary="Switch the served model (memory admission first)")
async def load_model(body: LoadBody, request: Request) -> dict:
    return await _manager(request).load(body.model)


@router.post("/unload", summary="Unload the served model (the API routes answer 503 until the next load)")
async def unload_model(request: Request) -> dict:
    return await _manager(request).unload()


@router.post("/add", status_code=201, summary="Record a GGUF file or Hugging Face folder under a name")
async def add_model(body: AddBody, request: Request) -> JSONResponse:
    row = await asyncio.to_thread(_manager(request).add, body.path, body.name)
    return JSONResponse(row, status_code=201)


@router.post("/verify", summary="Check a model's files against their SHA-256")
async def verify_model(body: VerifyBody, request: Request) -> dict:
    return await asyncio.to_thread(_manager(request).verify, body.model, body.manifest)
