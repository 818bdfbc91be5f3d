"""``lodestar models [add|verify|rm]``: list the known and local models, register one, check
one against a manifest, forget one."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lodestar.cli import CLIError

def _describe(path: Path) -> tuple[str, str]:
    from collections import Counter

    from lodestar.formats.gguf import GGUFFile
    g = GGUFFile(path)
    try:
        types = Counter()
        for t in g.tensors.values():
            if len(t.shape) > 1:
                types[t.qtype.name] += t.n_bytes
        quant = "+".join(name for name, _ in types.most_common(3))
        return g.config.arch, quant
    finally:
        g.close()


def cmd_models(a: argparse.Namespace) -> int:
    from lodestar.formats.registry import ManifestError, RegistryError
    command = getattr(a, "models_command", None)
    try:
        if command == "add":
            return _models_add(a)
        if command == "verify":
            return _models_verify(a)
        if command == "rm":
            return _models_rm(a)
        return _models_list()
    except ValueError as e:
        from lodestar.formats.safetensors import HFCheckpointError   # imports torch: only when needed
        if isinstance(e, (RegistryError, ManifestError, HFCheckpointError)):
            raise CLIError(str(e)) from None
        raise


def _models_list() -> int:
    import datetime

    from lodestar.formats.catalog import KNOWN_MODELS, ModelNotFoundError, file_sha256, known_model_path, local_model_files
    from lodestar.formats.registry import ModelRegistry, build_manifest, describe, manifest_digest
    rows = []
    seen = set()
    for name, km in KNOWN_MODELS.items():
        try:
            path = known_model_path(name)
        except ModelNotFoundError as e:
            rows.append((name, "not installed", "-", "-", "-", str(e).split(": ", 1)[-1]))
            continue
        seen.add(path.resolve())
        arch, quant = _describe(path)
        rows.append((name, str(path), f"{path.stat().st_size / 1e6:.1f} MB", f"{arch} {quant}",
                     file_sha256(path), km.description))
    for m in ModelRegistry().entries():
        seen.add(m.path)
        added = f"added {datetime.datetime.fromtimestamp(m.added):%Y-%m-%d %H:%M}"
        if not m.path.exists():
            rows.append((m.name, str(m.path), "-", "-", "-", f"{added}; missing (`lodestar models rm {m.name}`)"))
            continue
        try:
            info = describe(m.path)
            digest = file_sha256(m.path) if m.path.is_file() else manifest_digest(build_manifest(m.path))
            rows.append((m.name, str(m.path), f"{info.size_bytes / 1e6:.1f} MB", f"{info.family} {info.quant}",
                         digest, added))
        except Exception as e:  # noqa: BLE001 -- a broken added model is listed, not fatal
            rows.append((m.name, str(m.path), "-", f"unreadable: {e}", "-", added))
    for path in local_model_files():
        if path.resolve() in seen:
            continue
        try:
            arch, quant = _describe(path)
        except Exception as e:  # a broken local file is listed, not fatal
            arch, quant = "?", f"unreadable: {e}"
        rows.append((path.stem, str(path), f"{path.stat().st_size / 1e6:.1f} MB", f"{arch} {quant}",
                     file_sha256(path), "local"))
    for name, path, size, quant, sha, desc in rows:
        print(f"{name}\n  path:   {path}\n  size:   {size}\n  quant:  {quant}\n  sha256: {sha}\n  about:  {desc}")
    return 0


def _models_add(a: argparse.Namespace) -> int:
    from lodestar.formats.registry import ModelRegistry, manifest_digest
    from lodestar.serve.web.models_api import check_loadable
    registry = ModelRegistry()
    entry = registry.add(a.path, a.name, check=check_loadable)
    digest = next(iter(entry.manifest.values())).sha256 if entry.kind == "gguf" else manifest_digest(entry.manifest)
    print(f"added {entry.name}: {entry.path} ({entry.kind}, {len(entry.manifest)} file(s), sha256 {digest})\n"
          f"  use it with --model {entry.name}; the registry is {registry.path}")
    return 0


def _models_verify(a: argparse.Namespace) -> int:
    from lodestar.formats.registry import (FileDigest, ModelRegistry, expected_manifest, locate, read_manifest, verify,
                                           write_manifest)
    registry = ModelRegistry()
    located = locate(a.model, registry)
    if a.manifest is not None:
        expected, source = read_manifest(a.manifest), str(a.manifest)
    else:
        expected, source = expected_manifest(located, registry)
    result = verify(located.path, expected, source)
    print(f"{located.name}: {located.path}")
    for f in result.files:
        print(f"  {f.status:<10} {f.path}  {f.sha256 or '-'}")
    print(f"sha256:   {result.sha256}")
    if a.write_manifest is not None:
        write_manifest({f.path: FileDigest(f.sha256, f.size) for f in result.files if f.sha256 is not None},
                       a.write_manifest)
        print(f"wrote the manifest of these files to {a.write_manifest}")
    if result.ok is None:
        print("nothing to compare with: pass --manifest FILE (as `--write-manifest FILE` writes it)")
        return 0
    where = {"added": "the hashes taken when it was added", "known": "this known model's published hash"}
    print(f"expected: {result.expected}  ({where.get(source, source)})")
    bad = [f for f in result.files if f.status != "ok"]
    if bad:
        print(f"lodestar: error: {located.name}: {len(bad)} of {len(result.files)} files do not match "
              f"({', '.join(f'{f.path} {f.status}' for f in bad[:3])})", file=sys.stderr)
        return 1
    print("ok: every file matches")
    return 0


def _models_rm(a: argparse.Namespace) -> int:
    from lodestar.formats.registry import ModelRegistry
    entry = ModelRegistry().remove(a.name)
    print(f"removed {entry.name} from the registry; {entry.path} stays where it is")
    return 0
