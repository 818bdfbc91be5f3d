import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest

from lodestar.agent.tools import (
    TOOLS,
    ToolResult,
    new_context,
    tool_schemas,
    validate_call,
)
from lodestar.agent.tools.search import GREP_MAX_MATCHES, GrepTool


@pytest.fixture
def ctx(tmp_path: Path):
    root = tmp_path / "proj"
    root.mkdir()
    return new_context(root, tmp_path / "spill")


def call(ctx, name: str, **args) -> ToolResult:
    checked = validate_call(name, args)
    assert not isinstance(checked, ToolResult), checked.content
    tool, args = checked
    return tool.run(args, ctx)


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout


# -- grep ----------------------------------------------------------------------------------------
@pytest.fixture
def tree(ctx):
    root = ctx.boundary.root
    (root / "a").mkdir()
    (root / "a" / "b.py").write_text("import os\nTODO: one\nx = 1\n")
    (root / "a.py").write_text("".join(f"line {i}\n" for i in range(1, 11)).replace("line 3", "TODO three")
                               .replace("line 5", "todo five").replace("line 9", "TODO nine"))
    (root / "win.txt").write_bytes(b"first\r\nTODO crlf\r\n")
    (root / "bin.dat").write_bytes(b"TODO\x00binary")
    (root / "huge.txt").write_text("TODO huge\n" + "x" * (3 << 20))
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("TODO in git\n")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "h.md").write_text("TODO hidden\n")
    return ctx


def grep(ctx, use_rg: bool, **args) -> ToolResult:
    tool = GrepTool(use_rg=use_rg)
    checked = validate_call("grep", args)
    assert not isinstance(checked, ToolResult), checked.content
    return tool.run(checked[1], ctx)


def test_grep_python_backend_output(tree):
    r = grep(tree, False, pattern="TODO")
    assert r.ok
    assert r.content.splitlines() == [
        ".hidden/h.md:1:TODO hidden",
        "a/b.py:2:TODO: one",          # folder by folder: a/ sorts before a.py
        "a.py:3:TODO three",
        "a.py:9:TODO nine",
        "win.txt:2:TODO crlf",
    ]


def test_grep_context_ignore_case_glob_and_path(tree):
    r = grep(tree, False, pattern="todo", ignore_case=True, context=1, path="a.py")
    assert r.content.splitlines() == ["a.py-2-line 2", "a.py:3:TODO three", "a.py-4-line 4", "a.py:5:todo five",
                                      "a.py-6-line 6", "--", "a.py-8-line 8", "a.py:9:TODO nine", "a.py-10-line 10"]
    assert grep(tree, False, pattern="TODO", glob="*.py").content.splitlines() == [
        "a/b.py:2:TODO: one", "a.py:3:TODO three", "a.py:9:TODO nine"]
    assert grep(tree, False, pattern="TODO", path="a").content == "a/b.py:2:TODO: one"
    r = grep(tree, False, pattern="nothing-here")
    assert r.ok and "no matches" in r.content


def test_grep_respects_gitignore_in_a_repository(tree):
    root = tree.boundary.root
    shutil.rmtree(root / ".git")          # the fixture's stand-in; a real repository now
    git(root, "init", "-q")
    (root / ".gitignore").write_text("a/\n")
    lines = grep(tree, False, pattern="TODO").content.splitlines()
    assert "a/b.py:2:TODO: one" not in lines and "a.py:3:TODO three" in lines


@pytest.mark.skipif(shutil.which("rg") is None, reason="ripgrep is not installed")
@pytest.mark.parametrize("args", [
    {"pattern": "TODO"}, {"pattern": "todo", "ignore_case": True, "context": 2}, {"pattern": "TODO", "glob": "*.py"},
    {"pattern": "line \\d", "path": "a.py", "context": 1}, {"pattern": "TODO", "path": "a"}, {"pattern": "absent"},
])
def test_grep_backends_give_identical_output(tree, args):
    via_rg = grep(tree, True, **args)
    via_python = grep(tree, False, **args)
    assert via_rg.data is None or via_rg.data["backend"] == "rg"
    assert via_rg.content == via_python.content


@pytest.mark.parametrize("use_rg", [False, pytest.param(True, marks=pytest.mark.skipif(
    shutil.which("rg") is None, reason="ripgrep is not installed"))])
def test_grep_is_bounded(ctx, use_rg):
    (ctx.boundary.root / "many.txt").write_text("".join(f"hit {i}\n" for i in range(GREP_MAX_MATCHES + 50)))
    r = grep(ctx, use_rg, pattern="hit")
    lines = r.content.splitlines()
    assert len(lines) == GREP_MAX_MATCHES + 1
    assert lines[-1].startswith("[50 more matches not shown")
    assert r.data["matches"] == GREP_MAX_MATCHES + 50


def test_grep_errors_and_cancel(tree):
    r = grep(tree, False, pattern="(unclosed")
    assert not r.ok and "bad pattern" in r.content
    assert TOOLS["grep"].assess({"pattern": "x", "path": "/etc"}, tree).refused
    assert not grep(tree, False, pattern="x", path="../").ok
    tree.cancel.set()
    r = grep(tree, False, pattern="TODO")
    assert not r.ok and "stopped by the user" in r.content


# -- git -----------------------------------------------------------------------------------------
@pytest.fixture
def repo(ctx):
    root = ctx.boundary.root
    git(root, "init", "-q", "-b", "main")
    (root / "a.txt").write_text("one\n")
    git(root, "add", "a.txt")
    git(root, "commit", "-q", "-m", "first commit")
    (root / "a.txt").write_text("one\ntwo\n")
    return ctx


def test_git_read_only_commands_work(repo):
    assert "first commit" in call(repo, "git", args=["log", "--oneline"]).content
    assert "+two" in call(repo, "git", args=["diff"]).content
    assert "a.txt" in call(repo, "git", args=["status", "--short"]).content
    assert "main" in call(repo, "git", args=["branch", "--list"]).content
    r = call(repo, "git", args=["show", "HEAD:missing.txt"])
    assert not r.ok and "exited with code" in r.content


@pytest.mark.parametrize("args", [["push"], ["reset", "--hard"], ["commit", "-m", "x"], ["-c", "core.pager=sh", "log"],
                                  ["branch", "new-branch"], ["branch", "-D", "main"], ["diff", "--output=x.txt"],
                                  ["diff", "--no-index", "/etc/passwd", "a.txt"],
                                  ["blame", "--contents", "/etc/passwd", "a.txt"]])
def test_git_refuses_what_is_not_a_read(repo, args):
    r = validate_call("git", {"args": args})
    assert isinstance(r, ToolResult) and not r.ok
    assert "not allowed" in r.content or "may only list" in r.content
    assert TOOLS["git"].assess({"args": args}, repo).refused
    assert not TOOLS["git"].run({"args": args}, repo).ok
    assert git(repo.boundary.root, "status", "--short") == " M a.txt\n"      # nothing changed
    assert not (repo.boundary.root / "x.txt").exists()


def test_git_refusal_names_the_allowed_commands(repo):
    r = validate_call("git", {"args": ["push", "origin"]})
    assert "status, diff, log, show, blame, branch, rev-parse, ls-files" in r.content


# -- todo ----------------------------------------------------------------------------------------
def test_todo_replaces_the_list_in_place(ctx):
    plan = ctx.todo
    r = call(ctx, "todo", items=[{"text": "read the code", "status": "done"},
                                 {"text": "fix   the\nbug", "status": "in_progress"},
                                 {"text": "run tests", "status": "pending"}])
    assert r.ok
    assert r.content.splitlines() == ["plan (1/3 done):", "[x] read the code", "[>] fix the bug", "[ ] run tests"]
    assert plan is ctx.todo and [i["status"] for i in plan] == ["done", "in_progress", "pending"]
    call(ctx, "todo", items=[{"text": "only", "status": "pending"}])
    assert plan == [{"text": "only", "status": "pending"}]
    bad = validate_call("todo", {"items": [{"text": "x", "status": "started"}]})
    assert isinstance(bad, ToolResult) and "started" in bad.content


# -- validation and schemas ----------------------------------------------------------------------
def test_every_schema_is_valid_draft_2020_12_and_closed():
    schemas = tool_schemas()
    assert [s["function"]["name"] for s in schemas] == list(TOOLS)
    for s in schemas:
        params = s["function"]["parameters"]
        jsonschema.Draft202012Validator.check_schema(params)
        assert s["type"] == "function" and s["function"]["description"]
        assert params["type"] == "object" and params["additionalProperties"] is False
    assert [s["function"]["name"] for s in tool_schemas(["read", "shell"])] == ["read", "shell"]
    with pytest.raises(ValueError, match="available"):
        tool_schemas(["read", "nope"])


@pytest.mark.parametrize("name,arguments,message", [
    ("rm", "{}", "unknown tool 'rm'; available tools: read"),
    ("read", '{"path": "a.py"', "not valid JSON"),
    ("read", "[1, 2]", "must be a JSON object"),
    ("read", "{}", "'path' is a required property"),
    ("read", '{"path": 3}', "at 'path': 3 is not of type 'string'"),
    ("read", '{"path": "a", "offset": 0}', "at 'offset'"),
    ("read", '{"path": "a", "extra": 1}', "'extra' was unexpected"),
    ("edit", {"path": "a", "edits": [{"old": "x"}]}, "at 'edits/0'"),
])
def test_validate_call_errors(name, arguments, message):
    r = validate_call(name, arguments)
    assert isinstance(r, ToolResult) and not r.ok
    assert message in r.content
    if name in TOOLS:
        assert f"expected: {name}(" in r.content      # the expected shape is named


def test_validate_call_accepts_text_and_dicts():
    tool, args = validate_call("read", json.dumps({"path": "a.py", "limit": 5}))
    assert tool is TOOLS["read"] and args == {"path": "a.py", "limit": 5}
    tool, args = validate_call("list", "")          # no arguments at all
    assert tool is TOOLS["list"] and args == {}
