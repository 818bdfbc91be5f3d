import logging
from pathlib import Path

import pytest

from lodestar.agent.instructions import (
    find_skills,
    global_dir,
    load_instructions,
    render_instructions,
    render_skills,
)


@pytest.fixture
def tree(tmp_path):
    """A global config folder and a project with nested folders."""
    glob = tmp_path / "config"
    root = tmp_path / "proj"
    (root / "src" / "api").mkdir(parents=True)
    glob.mkdir()
    return glob, root.resolve()


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_global_dir_follows_xdg_config_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert global_dir() == tmp_path / "lodestar"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert global_dir() == tmp_path / "home" / ".config" / "lodestar"


def test_order_global_then_root_down_to_cwd_local_after_each(tree):
    glob, root = tree
    _write(glob / "AGENTS.md", "global rules")
    _write(root / "AGENTS.md", "root rules")
    _write(root / "AGENTS.local.md", "my root overlay")
    _write(root / "src" / "AGENTS.local.md", "my src overlay")
    _write(root / "src" / "api" / "AGENTS.md", "api rules")
    _write(root / "docs" / "AGENTS.md", "not on the way to cwd")
    files = load_instructions(root, cwd=root / "src" / "api", global_path=glob)
    assert [f.text for f in files] == [
        "global rules", "root rules", "my root overlay", "my src overlay", "api rules"]
    assert [f.scope for f in files] == ["global", "project", "local", "local", "project"]
    # Without cwd only the root folder counts.
    assert [f.text for f in load_instructions(root, global_path=glob)] == [
        "global rules", "root rules", "my root overlay"]


def test_render_shows_paths_and_precedence(tree, monkeypatch):
    glob, root = tree
    monkeypatch.setenv("HOME", str(glob.parent))
    _write(glob / "AGENTS.md", "global rules")
    _write(root / "src" / "AGENTS.md", "src rules")
    text = render_instructions(load_instructions(root, cwd=root / "src", global_path=glob))
    assert "# Instructions from ~/config/AGENTS.md\n\nglobal rules" in text
    assert "# Instructions from src/AGENTS.md\n\nsrc rules" in text
    assert text.index("global rules") < text.index("src rules")
    assert "later file takes precedence" in text
    assert render_instructions([]) == ""


def test_cwd_outside_root_is_refused(tree, tmp_path):
    glob, root = tree
    with pytest.raises(ValueError, match="outside the project root"):
        load_instructions(root, cwd=tmp_path, global_path=glob)


def test_symlink_pointing_outside_project_is_skipped(tree, tmp_path, caplog):
    glob, root = tree
    secret = _write(tmp_path / "elsewhere" / "notes.md", "outside text")
    (root / "AGENTS.md").symlink_to(secret)
    _write(root / "shared.md", "inside text")
    (root / "src" / "AGENTS.md").symlink_to(root / "shared.md")   # inside: kept
    with caplog.at_level(logging.WARNING):
        files = load_instructions(root, cwd=root / "src", global_path=glob)
    assert [f.text for f in files] == ["inside text"]
    assert "outside the project" in caplog.text


def test_long_file_is_cut_with_a_note(tree):
    glob, root = tree
    _write(root / "AGENTS.md", "é" * 3000)        # 6000 bytes, two bytes a character
    [f] = load_instructions(root, global_path=glob, max_bytes=1001)
    body, note = f.text.split("\n\n", 1)
    assert body == "é" * 500                       # the split character is dropped, not mangled
    assert "6000 bytes" in note and "first 1001 bytes" in note
    [whole] = load_instructions(root, global_path=glob)
    assert whole.text == "é" * 3000


def _skill(folder: Path, name: str, text: str) -> Path:
    return _write(folder / name / "SKILL.md", text)


def test_skills_front_matter_and_defaults(tree):
    glob, root = tree
    skills_dir = root / ".agents" / "skills"
    _skill(skills_dir, "release", "---\nname: cut-release\ndescription: >\n  Tag and publish\n  a release.\n---\nSteps...\n")
    _skill(skills_dir, "bare", "---\n---\n\n# Format the changelog\nmore\n")
    _skill(skills_dir, "plain", "Run the linters first.\n")
    skills = find_skills(root, global_path=glob)
    got = {s.name: (s.description, s.scope, s.path) for s in skills}
    assert got == {
        "cut-release": ("Tag and publish a release.", "project", skills_dir / "release" / "SKILL.md"),
        "bare": ("Format the changelog", "project", skills_dir / "bare" / "SKILL.md"),
        "plain": ("Run the linters first.", "project", skills_dir / "plain" / "SKILL.md"),
    }
    assert [s.name for s in skills] == ["bare", "cut-release", "plain"]


def test_project_skill_overrides_global(tree):
    glob, root = tree
    _skill(glob / "skills", "review", "---\nname: review\ndescription: global review\n---\n")
    _skill(glob / "skills", "notes", "---\ndescription: global notes\n---\n")
    _skill(root / ".agents" / "skills", "my-review", "---\nname: review\ndescription: project review\n---\n")
    got = {s.name: (s.description, s.scope) for s in find_skills(root, global_path=glob)}
    assert got == {"review": ("project review", "project"), "notes": ("global notes", "global")}


def test_malformed_skills_are_skipped_with_a_warning(tree, caplog):
    glob, root = tree
    skills_dir = root / ".agents" / "skills"
    _skill(skills_dir, "bad-yaml", "---\nname: [unclosed\n---\n")
    _skill(skills_dir, "not-a-map", "---\n- a\n- b\n---\n")
    _skill(skills_dir, "no-end", "---\nname: x\n")
    _skill(skills_dir, "bad-name", "---\nname: {a: 1}\n---\n")
    (skills_dir / "bytes").mkdir()
    (skills_dir / "bytes" / "SKILL.md").write_bytes(b"\xff\xfe\x00bad")
    _skill(skills_dir, "good", "---\ndescription: works\n---\n")
    with caplog.at_level(logging.WARNING):
        skills = find_skills(root, global_path=glob)
    assert [s.name for s in skills] == ["good"]
    for folder in ("bad-yaml", "not-a-map", "no-end", "bad-name", "bytes"):
        assert folder in caplog.text


def test_render_skills(tree):
    glob, root = tree
    _skill(glob / "skills", "notes", "---\ndescription: global notes\n---\n")
    _skill(root / ".agents" / "skills", "review", "---\ndescription: review a diff\n---\n")
    text = render_skills(find_skills(root, global_path=glob), root)
    assert "- review: review a diff (read .agents/skills/review/SKILL.md)" in text
    assert f"- notes: global notes (read {glob / 'skills' / 'notes' / 'SKILL.md'})" in text
    assert "read its file with the read tool" in text
    assert render_skills([], root) == ""
