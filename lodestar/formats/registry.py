"""Models added by path, what a checkpoint holds, and file manifests with their check.

``lodestar models add PATH`` records a GGUF file or a Hugging Face folder under a name in a
small JSON registry (``$XDG_DATA_HOME/lodestar/models.json``, by default
``~/.local/share/lodestar/models.json``); the files stay where they are. The entry keeps the
manifest taken when the model was added -- SHA-256 and size of every file -- so ``verify``
can later tell whether the files changed. A manifest file is JSON::

    {"files": {"relative/path": {"sha256": "<64 hex digits>", "size": 123}}}

SHA-256 digests come from ``catalog.file_sha256``, cached by path, size and mtime, so a
file is hashed once until it changes. Writers of the registry take an exclusive ``flock``
and replace the file atomically: the CLI and a running server can both edit it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lodestar.formats.catalog import (ALIASES, KNOWN_MODELS, ModelNotFoundError, cached_file_sha256, file_sha256,
                                       known_model_path, models_dir)

REGISTRY_VERSION = 1
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,79}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class RegistryError(ValueError):
    """An added model that cannot be recorded or read; the message says what to do."""


class RegistryConflictError(RegistryError):
    """The name is taken by another model."""


class ManifestError(ValueError):
    """A manifest that is not of the documented shape; the message names the entry at fault."""


# -- what a checkpoint holds ------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointInfo:
    """What the model manager shows of a checkpoint, and what its memory estimate needs."""

    path: Path
    kind: str                 # "gguf" (one file) or "hf" (a Hugging Face folder)
    family: str               # the architecture as the engine names it ("llama", "gemma3", ...)
    quant: str                # the main weight types, most bytes first ("Q4_K+Q6_K", "BF16")
    context: int              # the context length the checkpoint declares
    size_bytes: int           # on disk (every file of a folder)
    weight_bytes: int         # tensor bytes as stored
    weight_elements: int      # tensor elements: what dequantizing to fp32/bf16 multiplies
    n_layers: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int

    def weights_bytes(self, mode: str) -> int:
        """Weight memory in a ``--dtype`` mode: packed keeps the stored bytes, fp32/bf16 dequantize."""
        return {"fp32": 4 * self.weight_elements, "bf16": 2 * self.weight_elements}.get(mode, self.weight_bytes)

    def kv_bytes(self, tokens: int, element_bytes: int) -> int:
        """KV cache memory for ``tokens`` positions (keys and values of every layer)."""
        return tokens * self.n_layers * self.n_kv_heads * (self.head_dim + self.v_head_dim) * element_bytes


def _quant(tensors) -> str:
    types: Counter = Counter()
    for t in tensors:
        if len(t.shape) > 1:
            types[t.qtype.name] += t.n_bytes
    return "+".join(name for name, _ in types.most_common(3))


def describe(path: str | Path) -> CheckpointInfo:
    """Read a GGUF file's header or a Hugging Face folder's config and tensor index (no weights);
    raises GGUFError / HFCheckpointError / ModelNotFoundError with the file and the fix."""
    path = Path(path)
    if path.is_dir():
        from lodestar.formats.safetensors import HFCheckpoint
        source, kind, close = HFCheckpoint(path), "hf", None
    elif path.is_file():
        from lodestar.formats.gguf import GGUFFile
        source = GGUFFile(path)
        kind, close = "gguf", source.close
    else:
        raise ModelNotFoundError(f"{path}: no such file or folder")
    try:
        cfg, tensors = source.config, list(source.tensors.values())
        return CheckpointInfo(
            path=path, kind=kind, family=cfg.arch, quant=_quant(tensors), context=cfg.context_length,
            size_bytes=sum(p.stat().st_size for _, p in model_files(path)),
            weight_bytes=sum(t.n_bytes for t in tensors),
            weight_elements=sum(math.prod(t.shape) for t in tensors),
            n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, v_head_dim=cfg.v_head_dim)
    finally:
        if close is not None:
            close()


class DescriptionCache:
    """``describe`` results keyed by every file's (size, mtime): a listing re-reads only what changed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[tuple, CheckpointInfo]] = {}

    def describe(self, path: str | Path) -> CheckpointInfo:
        path = Path(path)
        key = _files_key(path)
        with self._lock:
            hit = self._entries.get(str(path))
        if hit is not None and hit[0] == key:
            return hit[1]
        info = describe(path)
        with self._lock:
            self._entries[str(path)] = (key, info)
        return info


def _files_key(path: Path) -> tuple:
    try:
        return tuple((rel, p.stat().st_size, p.stat().st_mtime_ns) for rel, p in model_files(path))
    except OSError:
        return ()


# -- manifests --------------------------------------------------------------------------------
@dataclass(frozen=True)
class FileDigest:
    sha256: str
    size: int | None = None     # None: not recorded (a known model's published hash)


Manifest = dict[str, FileDigest]   # relative path -> digest


def model_files(path: str | Path) -> list[tuple[str, Path]]:
    """(relative path, path) of a model's files: the file itself, or every file under a folder
    except hidden ones (``.git``, ``.cache``), sorted."""
    path = Path(path)
    if path.is_file():
        return [(path.name, path)]
    if not path.is_dir():
        raise ModelNotFoundError(f"{path}: no such file or folder")
    out = []
    for p in path.rglob("*"):
        rel = p.relative_to(path)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            out.append((rel.as_posix(), p))
    return sorted(out)


def build_manifest(path: str | Path, hasher: Callable[[Path], str] = file_sha256) -> Manifest:
    """The manifest of a model's files as they are now (hashes each file not hashed since it changed)."""
    return {rel: FileDigest(hasher(p), p.stat().st_size) for rel, p in model_files(path)}


def manifest_json(manifest: Manifest) -> dict:
    """The manifest in its file format."""
    files = {}
    for rel, d in sorted(manifest.items()):
        files[rel] = {"sha256": d.sha256} if d.size is None else {"sha256": d.sha256, "size": d.size}
    return {"files": files}


def parse_manifest(data: object, source: str = "manifest") -> Manifest:
    """A manifest from its JSON value; ``ManifestError`` names the entry that is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise ManifestError(f'{source}: expected {{"files": {{"relative/path": {{"sha256": ..., "size": ...}}}}}}')
    if not data["files"]:
        raise ManifestError(f"{source}: lists no files")
    out: Manifest = {}
    for rel, entry in data["files"].items():
        where = f"{source}: files[{rel!r}]"
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts:
            raise ManifestError(f"{where}: must be a path relative to the model (no leading '/', no '..')")
        if not isinstance(entry, dict):
            raise ManifestError(f'{where}: expected {{"sha256": ..., "size": ...}}')
        sha = entry.get("sha256")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha.lower()):
            raise ManifestError(f"{where}.sha256: expected 64 hexadecimal digits")
        size = entry.get("size")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise ManifestError(f"{where}.size: expected a byte count (a whole number >= 0)")
        out[Path(rel).as_posix()] = FileDigest(sha.lower(), size)
    return out


def read_manifest(path: str | Path) -> Manifest:
    """A manifest file (as ``lodestar models verify --write-manifest`` writes it)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ManifestError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ManifestError(f"{path}: not a JSON manifest ({e})") from None
    return parse_manifest(data, str(path))


def write_manifest(manifest: Manifest, path: str | Path) -> None:
    Path(path).write_text(json.dumps(manifest_json(manifest), indent=2) + "\n", encoding="utf-8")


def manifest_digest(manifest: Manifest) -> str:
    """One SHA-256 for a set of files: of their ``sha256sum`` listing, sorted by path."""
    listing = "".join(f"{d.sha256}  {rel}\n" for rel, d in sorted(manifest.items()))
    return hashlib.sha256(listing.encode()).hexdigest()


@dataclass
class FileCheck:
    path: str                       # relative to the model
    size: int | None                # None: missing
    sha256: str | None              # None: missing
    expected_sha256: str | None     # None: nothing to compare with
    expected_size: int | None
    status: str                     # ok | changed | missing | unexpected | unchecked


@dataclass
class Verification:
    ok: bool | None                 # None: nothing to compare with
    sha256: str                     # the file's, or a folder's manifest_digest
    expected: str | None
    files: list[FileCheck] = field(default_factory=list)
    source: str | None = None       # where the expected digests came from: manifest | added | known


def verify(path: str | Path, expected: Manifest | None, source: str | None = None,
           hasher: Callable[[Path], str] = file_sha256) -> Verification:
    """Hash a model's files and compare them with ``expected``. A one-file model checked against a
    one-file manifest is compared whatever the file is called now (a renamed file still verifies)."""
    path = Path(path)
    actual = dict(model_files(path))
    single = path.is_file()
    if expected is not None and single and len(expected) == 1 and path.name not in expected:
        expected = {path.name: next(iter(expected.values()))}
    digests = {rel: FileDigest(hasher(p), p.stat().st_size) for rel, p in actual.items()}
    checks = []
    for rel in sorted(set(actual) | set(expected or {})):
        have, want = digests.get(rel), (expected or {}).get(rel)
        if expected is None:
            status = "unchecked"
        elif have is None:
            status = "missing"
        elif want is None:
            status = "unexpected"
        elif have.sha256 == want.sha256 and (want.size is None or want.size == have.size):
            status = "ok"
        else:
            status = "changed"
        checks.append(FileCheck(rel, have and have.size, have and have.sha256, want and want.sha256,
                                want and want.size, status))
    if single:
        sha = digests[path.name].sha256
        want = expected.get(path.name) if expected else None
        expected_top = want.sha256 if want else None
    else:
        sha = manifest_digest(digests)
        expected_top = manifest_digest(expected) if expected else None
    ok = None if expected is None else all(c.status == "ok" for c in checks)
    return Verification(ok, sha, expected_top, checks, source if expected is not None else None)


def cached_digest(path: str | Path) -> str | None:
    """The model's SHA-256 (a folder's manifest digest) when every file's hash is cached; never hashes."""
    files = model_files(path)
    digests = {rel: cached_file_sha256(p) for rel, p in files}
    if any(d is None for d in digests.values()):
        return None
    if Path(path).is_file():
        return digests[files[0][0]]
    return manifest_digest({rel: FileDigest(d) for rel, d in digests.items()})


# -- the registry -----------------------------------------------------------------------------
def registry_path() -> Path:
    """``$XDG_DATA_HOME/lodestar/models.json`` (``~/.local/share`` when XDG_DATA_HOME is unset)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "lodestar" / "models.json"


@dataclass(frozen=True)
class AddedModel:
    name: str
    path: Path              # absolute
    kind: str               # "gguf" or "hf"
    added: float            # Unix time
    manifest: Manifest      # the files' digests when the model was added


def default_name(path: Path) -> str:
    """A registry name from a file's stem or a folder's name."""
    raw = path.stem if path.is_file() else path.name
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", raw).lstrip("-._+")[:80]
    return name or "model"


def check_name(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise RegistryError(f"model name {name!r}: use 1-80 letters, digits, '.', '_', '+' or '-', starting "
                            "with a letter or digit")
    if name in KNOWN_MODELS or name in ALIASES:
        raise RegistryError(f"model name {name!r} is a built-in model's; choose another with --name")


class ModelRegistry:
    """The added-models file; ``path`` defaults to ``registry_path()``."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else registry_path()

    def entries(self) -> list[AddedModel]:
        return sorted(self._read().values(), key=lambda m: m.name)

    def get(self, name: str) -> AddedModel | None:
        if not NAME_PATTERN.fullmatch(name):
            return None             # a path or other spec, not a name
        return self._read().get(name)

    def add(self, path: str | Path, name: str | None = None, *, check: Callable[[Path], object] | None = None,
            hasher: Callable[[Path], str] = file_sha256) -> AddedModel:
        """Record a GGUF file or Hugging Face folder under ``name`` (default: its file stem or
        folder name). ``check`` may refuse it (the engine's own load checks) by raising. Adding the
        same path under the same name again refreshes its manifest."""
        try:
            path = Path(path).expanduser()
        except RuntimeError:          # "~user" of no such user
            raise RegistryError(f"{path}: cannot expand the home folder in this path; give a full path") from None
        if not path.exists():
            raise ModelNotFoundError(f"{path}: no such file or folder")
        path = path.resolve()
        if path.is_file():
            with open(path, "rb") as f:
                if f.read(4) != b"GGUF":
                    raise RegistryError(f"{path}: not a GGUF file; a model is a .gguf file or a Hugging Face "
                                        "folder (config.json + *.safetensors)")
            kind = "gguf"
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise RegistryError(f"{path}: no config.json, so not a Hugging Face model folder; give a .gguf file "
                                    "or a folder with config.json, *.safetensors and tokenizer.json")
            kind = "hf"
        else:
            raise RegistryError(f"{path}: not a regular file or folder")
        name = name if name is not None else default_name(path)
        check_name(name)
        self._check_free(name, path)        # before the checks and the hashing, which can take seconds
        describe(path)                      # format errors name the file
        if check is not None:
            check(path)
        entry = AddedModel(name, path, kind, time.time(), build_manifest(path, hasher))
        with self._locked():
            models = self._read()
            self._check_free(name, path, models)
            models[name] = entry
            self._write(models)
        return entry

    def remove(self, name: str) -> AddedModel:
        """Forget an added model (its files are not touched)."""
        with self._locked():
            models = self._read()
            entry = models.pop(name, None)
            if entry is None:
                known = ", ".join(models) or "none"
                raise ModelNotFoundError(f"no added model is named {name!r} (added models: {known})")
            self._write(models)
        return entry

    # -- the file -------------------------------------------------------------------------
    def _check_free(self, name: str, path: Path, models: dict[str, AddedModel] | None = None) -> None:
        other = (models if models is not None else self._read()).get(name)
        if other is not None and other.path != path:
            raise RegistryConflictError(f"the name {name!r} is taken by {other.path}; choose another with --name, "
                                        f"or forget that one first (`lodestar models rm {name}`)")

    def _fail(self, what: str) -> RegistryError:
        return RegistryError(f"{self.path}: {what}; fix or delete that file (it only lists added models, "
                             "their files are not touched)")

    def _read(self) -> dict[str, AddedModel]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):     # nothing added yet
            return {}
        except (OSError, UnicodeDecodeError) as e:
            raise self._fail(f"cannot read it ({getattr(e, 'strerror', None) or e})") from None
        try:
            data = json.loads(text)
        except ValueError as e:
            raise self._fail(f"not valid JSON ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
            raise self._fail('expected {"version": 1, "models": {...}}')
        if data.get("version") != REGISTRY_VERSION:
            raise self._fail(f"version {data.get('version')!r}, this lodestar reads version {REGISTRY_VERSION}")
        out = {}
        for name, e in data["models"].items():
            try:
                out[name] = AddedModel(name, Path(e["path"]), str(e["kind"]), float(e["added"]),
                                       parse_manifest({"files": e["files"]}, f"models[{name!r}]"))
            except (KeyError, TypeError, ValueError) as err:
                raise self._fail(f"models[{name!r}] is malformed ({err})") from None
        return out

    def _write(self, models: dict[str, AddedModel]) -> None:
        data = {"version": REGISTRY_VERSION, "models": {
            m.name: {"path": str(m.path), "kind": m.kind, "added": m.added, **manifest_json(m.manifest)}
            for m in sorted(models.values(), key=lambda m: m.name)}}
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise self._unwritable(e) from None

    def _unwritable(self, e: OSError) -> RegistryError:
        return RegistryError(f"{self.path}: cannot write the model registry ({e.strerror or e}); set "
                             "XDG_DATA_HOME to a writable folder")

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.path.with_name(self.path.name + ".lock"), "a")  # noqa: SIM115 -- closed below
        except OSError as e:
            raise self._unwritable(e) from None
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield


# -- resolving a name -------------------------------------------------------------------------
def added_folder(name: str) -> Path | None:
    """The Hugging Face folder ``lodestar models add`` recorded under ``name`` (None: no such
    name, or the name is a GGUF file's, which ``catalog.resolve_model_path`` finds)."""
    if not NAME_PATTERN.fullmatch(name):
        return None
    added = ModelRegistry().get(name)
    return added.path if added is not None and added.kind == "hf" else None


@dataclass(frozen=True)
class Located:
    name: str       # what the model is called (known name, added name, or the file's stem)
    path: Path      # a GGUF file or a Hugging Face folder
    source: str     # known | added | local | path


def locate(spec: str, registry: ModelRegistry | None = None) -> Located:
    """A known name or alias, an added model's name, a GGUF file or Hugging Face folder path, or a
    file in the local model folder."""
    if spec in ALIASES or spec in KNOWN_MODELS:
        return Located(ALIASES.get(spec, spec), known_model_path(spec), "known")
    registry = registry or ModelRegistry()
    added = registry.get(spec)
    if added is not None:
        if not added.path.exists():
            raise ModelNotFoundError(f"model {spec!r} was added from {added.path}, which no longer exists: add it "
                                     f"again (`lodestar models add PATH --name {spec}`) or forget it "
                                     f"(`lodestar models rm {spec}`)")
        return Located(added.name, added.path, "added")
    path = Path(spec).expanduser()
    if path.is_file() or path.is_dir():
        return Located(path.stem if path.is_file() else path.name, path.resolve(), "path")
    local = models_dir() / spec
    if local.is_file():
        return Located(local.stem, local, "local")
    names = ", ".join(list(ALIASES) + list(KNOWN_MODELS) + [m.name for m in registry.entries()])
    raise ModelNotFoundError(f"model {spec!r} not found: give a GGUF file or Hugging Face folder path, or one of "
                             f"{names}; add a model under a name with `lodestar models add PATH`")


def expected_manifest(located: Located, registry: ModelRegistry | None = None) -> tuple[Manifest | None, str | None]:
    """What the model's files should hash to without a manifest given: the digests taken when it was
    added, or a known model's published SHA-256; (None, None) when there is nothing to compare with."""
    if located.source == "added":
        entry = (registry or ModelRegistry()).get(located.name)
        if entry is not None:
            return entry.manifest, "added"
    if located.source == "known":
        known = KNOWN_MODELS[located.name]
        if known.sha256:
            return {located.path.name: FileDigest(known.sha256)}, "known"
    return None, None
