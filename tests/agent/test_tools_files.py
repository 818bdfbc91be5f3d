import os
import re
import subprocess
from pathlib import Path

import pytest

from lodestar.agent.tools import TOOLS, ToolResult, new_context, validate_call
from lodestar.agent.tools.files import GLOB_MAX_RESULTS, READ_MAX_CHARS, glob_regex


@pytest.fixture
def ctx(tmp_path: Path):
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)
    (root / "src" / "a.py").write_text("def f():\n    return 1\n\n\ndef g():\n    return 2\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("s3cret\n")
    return new_context(root, tmp_path / "spill")


def call(ctx, name: str, **args) -> ToolResult:
    checked = validate_call(name, args)
    assert not isinstance(checked, ToolResult), checked.content
    tool, args = checked
    return tool.run(args, ctx)


def numbered_text(content: str) -> list[str]:
    """The file lines of a read result (the 'N<TAB>' prefixes and the continuation note removed)."""
    return [ln.split("\t", 1)[1] for ln in content.splitlines() if re.match(r"\s*\d+\t", ln)]


# -- read ----------------------------------------------------------------------------------------
def test_read_numbers_lines(ctx):
    r = call(ctx, "read", path="src/a.py")
    assert r.ok
    assert r.content.splitlines()[0] == "     1\tdef f():"
    assert numbered_text(r.content) == ["def f():", "    return 1", "", "", "def g():", "    return 2"]
    assert "offset=" not in r.content


def test_read_offset_and_limit(ctx):
    r = call(ctx, "read", path="src/a.py", offset=2, limit=2)
    assert numbered_text(r.content) == ["    return 1", ""]
    assert r.content.rstrip().endswith("continue with offset=4]")


def test_read_continuation_offsets_reassemble_the_whole_file(ctx):
    lines = [f"line {i} " + "x" * (i % 97) for i in range(3000)]
    (ctx.boundary.root / "big.txt").write_text("\n".join(lines) + "\n")
    got, offset, calls = [], 1, 0
    while True:
        r = call(ctx, "read", path="big.txt", offset=offset)
        assert r.ok and len(r.content) <= READ_MAX_CHARS + 200
        got += numbered_text(r.content)
        calls += 1
        m = re.search(r"continue with offset=(\d+)\]$", r.content)
        if not m:
            break
        offset = int(m.group(1))
    assert got == lines
    assert calls > 3                      # the byte budget cut it, not only the line limit


def test_read_past_the_end_and_empty_and_missing(ctx):
    r = call(ctx, "read", path="src/a.py", offset=99)
    assert not r.ok and "past the end" in r.content and "6 lines" in r.content
    (ctx.boundary.root / "empty.txt").write_text("")
    assert "empty" in call(ctx, "read", path="empty.txt").content
    r = call(ctx, "read", path="src/b.py")
    assert not r.ok and "no such file" in r.content and "src/a.py" in r.content   # a similar name is suggested
    r = call(ctx, "read", path="src")
    assert not r.ok and "folder" in r.content


def test_read_refuses_binary_with_size_and_type(ctx):
    (ctx.boundary.root / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))
    r = call(ctx, "read", path="img.png")
    assert not r.ok and "binary" in r.content and "208 bytes" in r.content and "PNG" in r.content
    (ctx.boundary.root / "blob.bin").write_bytes(b"abc\x00def")
    assert "binary" in call(ctx, "read", path="blob.bin").content


def test_read_cuts_a_very_long_line(ctx):
    (ctx.boundary.root / "min.js").write_text("a" * 100_000 + "\nnext\n")
    r = call(ctx, "read", path="min.js")
    assert r.ok and len(r.content) < 5_000 and "more characters on this line" in r.content and "next" in r.content


def test_read_outside_is_refused_by_assess_and_run(ctx):
    tool = TOOLS["read"]
    for path in ("../outside/secret.txt", "/proc/self/environ", "/etc/passwd"):
        assert tool.assess({"path": path}, ctx).refused
        r = tool.run({"path": path}, ctx)
        assert not r.ok and "s3cret" not in r.content


def test_read_spill_dir_is_allowed(ctx):
    (ctx.spill_dir / "shell-1.txt").write_text("spilled\n")
    r = call(ctx, "read", path=str(ctx.spill_dir / "shell-1.txt"))
    assert r.ok and "spilled" in r.content


# -- write ---------------------------------------------------------------------------------------
def test_write_creates_parents_and_reports_a_diff(ctx):
    r = call(ctx, "write", path="pkg/sub/new.py", content="a = 1\nb = 2\n")
    assert r.ok and "2 lines" in r.content and "new file" in r.content
    assert (ctx.boundary.root / "pkg/sub/new.py").read_text() == "a = 1\nb = 2\n"
    assert "+a = 1" in r.display and r.data["path"] == "pkg/sub/new.py" and r.data["created"]


def test_write_overwrite_diff_and_keeps_mode(ctx):
    script = ctx.boundary.root / "run.sh"
    script.write_text("echo 1\necho 2\n")
    script.chmod(0o755)
    assessment = TOOLS["write"].assess({"path": "run.sh", "content": "echo 1\necho 3\n"}, ctx)
    assert assessment.kind == "write" and "(+1 -1)" in assessment.summary and assessment.target == "run.sh"
    r = call(ctx, "write", path="run.sh", content="echo 1\necho 3\n")
    assert r.ok and "+1 -1" in r.content
    assert "-echo 2" in r.data["diff"] and "+echo 3" in r.data["diff"]
    assert script.read_text() == "echo 1\necho 3\n" and os.stat(script).st_mode & 0o777 == 0o755


def test_write_outside_and_through_symlinks_is_refused(ctx, tmp_path):
    root = ctx.boundary.root
    (root / "out").symlink_to(tmp_path / "outside")
    (root / "secret-link").symlink_to(tmp_path / "outside" / "secret.txt")
    for path in ("../outside/new.txt", "out/new.txt", "out/deep/new.txt", "secret-link", "/tmp/x.txt"):
        assert TOOLS["write"].assess({"path": path, "content": "x"}, ctx).refused, path
        r = TOOLS["write"].run({"path": path, "content": "pwned"}, ctx)
        assert not r.ok, path
    assert (tmp_path / "outside" / "secret.txt").read_text() == "s3cret\n"
    assert not (tmp_path / "outside" / "new.txt").exists() and not (tmp_path / "outside" / "deep").exists()


def test_write_onto_a_folder_fails(ctx):
    r = call(ctx, "write", path="src", content="x")
    assert not r.ok and "folder" in r.content


# -- edit ----------------------------------------------------------------------------------------
def test_edit_replaces_a_unique_match_with_a_diff(ctx):
    r = call(ctx, "edit", path="src/a.py", old="    return 2", new="    return 20")
    assert r.ok and "1 replacement" in r.content and "+    return 20" in r.content
    assert "return 20" in (ctx.boundary.root / "src/a.py").read_text()
    assert r.data["replacements"] == 1 and "-    return 2" in r.display


def test_edit_zero_matches_names_the_closest_line(ctx):
    before = (ctx.boundary.root / "src/a.py").read_text()
    r = call(ctx, "edit", path="src/a.py", old="def gg():\n    return 2", new="x")
    assert not r.ok and "not found" in r.content and "5: def g():" in r.content
    r = call(ctx, "edit", path="src/a.py", old="def g():\n  return 2", new="x")
    assert not r.ok and "whitespace" in r.content
    r = call(ctx, "edit", path="src/a.py", old="     5\tdef g():", new="x")
    assert not r.ok and "line numbers" in r.content
    assert (ctx.boundary.root / "src/a.py").read_text() == before


def test_edit_several_matches_lists_their_lines(ctx):
    r = call(ctx, "edit", path="src/a.py", old="    return", new="    yield")
    assert not r.ok and "2 times" in r.content and "lines 2, 6" in r.content
    r = call(ctx, "edit", path="src/a.py", old="    return", new="    yield", replace_all=True)
    assert r.ok and "2 replacements" in r.content
    assert (ctx.boundary.root / "src/a.py").read_text().count("yield") == 2


def test_multi_edit_is_all_or_nothing(ctx):
    path = ctx.boundary.root / "src/a.py"
    before = path.read_text()
    r = call(ctx, "edit", path="src/a.py", edits=[{"old": "def f():", "new": "def h():"},
                                                  {"old": "missing text", "new": "x"}])
    assert not r.ok and "edit 2 of 2" in r.content
    assert path.read_text() == before
    # edits apply in order: the second sees the first's result
    r = call(ctx, "edit", path="src/a.py", edits=[{"old": "def f():", "new": "def h():"},
                                                  {"old": "def h():\n    return 1", "new": "def h():\n    return 3"}])
    assert r.ok and path.read_text().startswith("def h():\n    return 3\n")


def test_edit_keeps_crlf_line_endings(ctx):
    path = ctx.boundary.root / "win.txt"
    path.write_bytes(b"one\r\ntwo\r\nthree\r\n")
    r = call(ctx, "edit", path="win.txt", old="one\ntwo", new="one\nTWO")
    assert r.ok
    assert path.read_bytes() == b"one\r\nTWO\r\nthree\r\n"


@pytest.mark.parametrize("args,message", [
    ({"path": "src/a.py"}, "give old and new"),
    ({"path": "src/a.py", "old": "x"}, "go together"),
    ({"path": "src/a.py", "old": "a", "new": "a"}, "identical"),
    ({"path": "src/a.py", "old": "", "new": "a"}, "use write"),
    ({"path": "src/a.py", "old": "a", "new": "b", "edits": [{"old": "a", "new": "b"}]}, "not both"),
])
def test_edit_malformed_calls_are_rejected_before_running(ctx, args, message):
    r = validate_call("edit", args)
    assert isinstance(r, ToolResult) and not r.ok and message in r.content


def test_edit_missing_file_and_outside(ctx):
    r = call(ctx, "edit", path="src/nope.py", old="a", new="b")
    assert not r.ok and "no such file" in r.content
    assert TOOLS["edit"].assess({"path": "../outside/secret.txt", "old": "s", "new": "t"}, ctx).refused


# -- list ----------------------------------------------------------------------------------------
def test_list_marks_folders_and_sizes(ctx):
    root = ctx.boundary.root
    (root / "README.md").write_text("x" * 2048)
    (root / "link").symlink_to("src/a.py")
    r = call(ctx, "list")
    lines = r.content.splitlines()
    assert r.ok and "src/" in lines and "README.md  2.0 KB" in lines and "link -> src/a.py" in lines
    assert lines.index("src/") < lines.index("README.md  2.0 KB")
    r = call(ctx, "list", path="src")
    assert r.ok and any(ln.startswith("a.py  ") for ln in r.content.splitlines())
    assert not call(ctx, "list", path="src/a.py").ok
    assert not call(ctx, "list", path="..").ok


def test_list_is_bounded(ctx):
    many = ctx.boundary.root / "many"
    many.mkdir()
    for i in range(450):
        (many / f"f{i:03d}").touch()
    r = call(ctx, "list", path="many")
    assert "and 50 more entries" in r.content and len(r.content.splitlines()) == 402


# -- glob ----------------------------------------------------------------------------------------
def test_glob_regex():
    assert glob_regex("**/*.py").match("a/b/c.py") and glob_regex("**/*.py").match("c.py")
    assert not glob_regex("*.py").match("a/c.py")
    assert glob_regex("src/*.{js,ts}").match("src/x.ts") and not glob_regex("src/*.{js,ts}").match("src/x.tsx")
    assert glob_regex("test_[ab].py").match("test_a.py") and not glob_regex("test_[!ab].py").match("test_a.py")


def test_glob_recursive_newest_first_skipping_git(ctx):
    root = ctx.boundary.root
    (root / "src" / "deep").mkdir()
    (root / "src" / "deep" / "b.py").write_text("")
    (root / ".git").mkdir()
    (root / ".git" / "hook.py").write_text("")
    os.utime(root / "src" / "a.py", (1, 1))
    r = call(ctx, "glob", pattern="*.py")
    assert r.content.splitlines() == ["src/deep/b.py", "src/a.py"]
    r = call(ctx, "glob", pattern="**/*.py", sort="name")
    assert r.content.splitlines() == ["src/a.py", "src/deep/b.py"]
    r = call(ctx, "glob", pattern="deep/*.py", path="src")
    assert r.content.splitlines() == ["src/deep/b.py"]
    assert "no files match" in call(ctx, "glob", pattern="*.rs").content


def test_glob_respects_gitignore_in_a_repository(ctx):
    root = ctx.boundary.root
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text("build/\n")
    (root / "build").mkdir()
    (root / "build" / "gen.py").write_text("")
    assert call(ctx, "glob", pattern="*.py").content.splitlines() == ["src/a.py"]


def test_glob_bounded_and_refuses_escapes(ctx):
    many = ctx.boundary.root / "many"
    many.mkdir()
    for i in range(GLOB_MAX_RESULTS + 30):
        (many / f"f{i}.txt").touch()
    r = call(ctx, "glob", pattern="*.txt")
    assert len(r.content.splitlines()) == GLOB_MAX_RESULTS + 1 and "and 30 more" in r.content
    assert not call(ctx, "glob", pattern="../*").ok
    assert not call(ctx, "glob", pattern="/etc/*").ok
    assert TOOLS["glob"].assess({"pattern": "*", "path": "/etc"}, ctx).refused


def test_file_system_errors_become_failed_results(ctx, monkeypatch):
    import lodestar.agent.tools.files as files

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(files, "binary_kind", denied)
    r = TOOLS["read"].run({"path": "src/a.py"}, ctx)
    assert not r.ok and "Permission denied" in r.content and "a.py" in r.content
