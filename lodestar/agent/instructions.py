"""Instruction files (AGENTS.md) and skills (SKILL.md) that go into the agent's system prompt.

Skill front matter is YAML, parsed with PyYAML (``yaml.safe_load``): the format other
agents use is full YAML, and PyYAML is the maintained parser for it.
"""
from __future__ import annotations

import codecs
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

INSTRUCTIONS_NAME = "AGENTS.md"
LOCAL_INSTRUCTIONS_NAME = "AGENTS.local.md"   # a personal overlay, usually not committed
SKILL_NAME = "SKILL.md"
PROJECT_SKILLS_DIR = Path(".agents") / "skills"
DESCRIPTION_CHARS = 200


def global_dir() -> Path:
    """``$XDG_CONFIG_HOME/lodestar``, else ``~/.config/lodestar``."""
    config_home = os.environ.get("XDG_CONFIG_HOME", "")
    # The XDG spec says relative values are invalid and must be ignored.
    base = Path(config_home) if os.path.isabs(config_home) else Path.home() / ".config"
    return base / "lodestar"


def _shown(path: Path, root: Path | None) -> str:
    """``path`` relative to the project root (when given), else under ``~``, else absolute."""
    bases = [(Path.home(), "~/")] if root is None else [(root, ""), (Path.home(), "~/")]
    for base, prefix in bases:
        try:
            return prefix + path.relative_to(base).as_posix()
        except ValueError:
            continue
    return str(path)


def _inside(path: Path, root: Path) -> bool:
    """Whether ``path``, with every symlink followed, stays inside ``root``."""
    try:
        path.resolve().relative_to(root)
        return True
    except (ValueError, OSError):
        return False


# ---------------------------------------------------------------------------- AGENTS.md


@dataclass
class InstructionFile:
    path: Path
    text: str
    scope: str      # "global" (user config), "project" (an AGENTS.md), "local" (an AGENTS.local.md)
    shown_as: str = ""   # the path as headers show it: relative to the root, or under ~


def _read_capped(path: Path, max_bytes: int) -> str | None:
    try:
        data = path.read_bytes()
    except OSError as e:
        log.warning("skipping instruction file %s: %s", path, e)
        return None
    if len(data) <= max_bytes:
        return data.decode("utf-8", errors="replace")
    # final=False drops a multi-byte character split by the cut instead of mangling it.
    head = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data[:max_bytes], final=False)
    return (
        head.rstrip()
        + f"\n\n[{path.name} is {len(data)} bytes; only its first {max_bytes} bytes are shown. "
        "Read the file for the rest.]"
    )


def load_instructions(root: Path, cwd: Path | None = None, global_path: Path | None = None,
                      max_bytes: int = 32_768) -> list[InstructionFile]:
    """Instruction files in precedence order, lowest first: the global AGENTS.md (in
    ``global_path``, default `global_dir()`), then for each folder from ``root`` down to
    ``cwd`` its AGENTS.md and then its AGENTS.local.md. Project files that are symlinks
    to somewhere outside the project are skipped."""
    root = Path(root).resolve()
    cwd = root if cwd is None else Path(cwd).resolve()
    try:
        below = cwd.relative_to(root)
    except ValueError:
        raise ValueError(
            f"working folder {cwd} is outside the project root {root}; "
            "start the agent inside the project or pass the right project root"
        ) from None
    files: list[InstructionFile] = []
    global_file = (global_dir() if global_path is None else Path(global_path)) / INSTRUCTIONS_NAME
    if global_file.is_file():
        text = _read_capped(global_file, max_bytes)
        if text is not None:
            files.append(InstructionFile(global_file, text, "global", _shown(global_file, None)))
    folders = [root] + [root.joinpath(*below.parts[: i + 1]) for i in range(len(below.parts))]
    for folder in folders:
        for name, scope in ((INSTRUCTIONS_NAME, "project"), (LOCAL_INSTRUCTIONS_NAME, "local")):
            path = folder / name
            if not path.is_file():
                continue
            if not _inside(path, root):
                log.warning("skipping %s: it links to a file outside the project %s", path, root)
                continue
            text = _read_capped(path, max_bytes)
            if text is not None:
                files.append(InstructionFile(path, text, scope, _shown(path, root)))
    return files


def render_instructions(files: list[InstructionFile]) -> str:
    """One system-prompt block with every file under its own header; "" for no files."""
    if not files:
        return ""
    parts = [(
        "The instruction files below apply to this project. Where they disagree, "
        "a later file takes precedence over an earlier one."
    )]
    for f in files:
        parts.append(f"# Instructions from {f.shown_as or f.path}\n\n{f.text.strip()}")
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------- skills


@dataclass
class Skill:
    name: str
    description: str
    path: Path      # its SKILL.md
    scope: str      # "global" | "project"


class _Malformed(Exception):
    pass


def _split_front_matter(text: str) -> tuple[dict, str]:
    """(front matter mapping, body); a file without front matter has an empty mapping."""
    lines = text.lstrip("\ufeff").splitlines()
    if not lines or lines[0].strip() != "---":
        return {}, text
    for i, line in enumerate(lines[1:], start=1):
        if line.strip() in ("---", "..."):
            try:
                data = yaml.safe_load("\n".join(lines[1:i]))
            except yaml.YAMLError as e:
                raise _Malformed(f"front matter is not valid YAML: {e}") from e
            if data is None:
                data = {}
            if not isinstance(data, dict):
                raise _Malformed("front matter is not a mapping of keys to values")
            return data, "\n".join(lines[i + 1:])
    raise _Malformed("front matter has no closing '---' line")


def _first_line(body: str) -> str:
    for line in body.splitlines():
        line = line.strip().lstrip("#").strip()
        if line:
            return line
    return ""


def _read_skill(path: Path, folder_name: str, scope: str) -> Skill:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise _Malformed(f"cannot read it: {e}") from e
    front, body = _split_front_matter(text)
    name = front.get("name", folder_name)
    description = front.get("description", None)
    if not isinstance(name, str) or not name.strip():
        raise _Malformed("'name' must be a non-empty string")
    if description is None:
        description = _first_line(body)
    if not isinstance(description, str):
        raise _Malformed("'description' must be a string")
    description = " ".join(description.split())
    if len(description) > DESCRIPTION_CHARS:
        description = description[: DESCRIPTION_CHARS - 1].rstrip() + "…"
    return Skill(name.strip(), description, path, scope)


def _skills_in(folder: Path, scope: str, root: Path) -> dict[str, Skill]:
    found: dict[str, Skill] = {}
    if not folder.is_dir():
        return found
    for skill_dir in sorted(folder.iterdir()):
        path = skill_dir / SKILL_NAME
        if not path.is_file():
            continue
        if scope == "project" and not _inside(path, root):
            log.warning("skipping skill %s: it links to a file outside the project %s", path, root)
            continue
        try:
            skill = _read_skill(path, skill_dir.name, scope)
        except _Malformed as e:
            log.warning("skipping skill %s: %s", path, e)
            continue
        if skill.name in found:
            log.warning("skipping skill %s: name %r is already used by %s",
                        path, skill.name, found[skill.name].path)
            continue
        found[skill.name] = skill
    return found


def find_skills(root: Path, global_path: Path | None = None) -> list[Skill]:
    """Skills from ``<global>/skills/<name>/SKILL.md`` and ``<root>/.agents/skills/<name>/SKILL.md``,
    sorted by name; a project skill replaces a global one of the same name."""
    root = Path(root).resolve()
    base = global_dir() if global_path is None else Path(global_path)
    skills = _skills_in(base / "skills", "global", root)
    skills.update(_skills_in(root / PROJECT_SKILLS_DIR, "project", root))
    return [skills[name] for name in sorted(skills)]


def render_skills(skills: list[Skill], root: Path) -> str:
    """A short system-prompt list of the skills; "" for none."""
    if not skills:
        return ""
    root = Path(root).resolve()
    lines = [
        "# Skills",
        ("Each skill below is a file of instructions for one kind of task. Before you use a "
         "skill, read its file with the read tool and follow it."),
    ]
    for skill in skills:
        # Paths outside the project stay absolute: the read tool does not expand "~".
        try:
            where = skill.path.relative_to(root).as_posix()
        except ValueError:
            where = str(skill.path)
        about = f": {skill.description}" if skill.description else ""
        lines.append(f"- {skill.name}{about} (read {where})")
    return "\n".join(lines) + "\n"
