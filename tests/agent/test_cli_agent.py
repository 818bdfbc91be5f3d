"""`lodestar agent` from the command line with the real default model in-process: one
prompt, a resumed session reading its KV checkpoint from the disk tier, sessions listing,
and one-line errors for bad options."""
from __future__ import annotations

import re

import pytest

from lodestar.agent.store import AgentStore
from lodestar.cli import main


def test_prompt_then_resume_after_restart_reads_the_checkpoint(tmp_path, smollm_path, capsys):
    project, db, kv = tmp_path / "p", tmp_path / "agent.db", tmp_path / "kv"
    project.mkdir()
    (project / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    common = ["--project", str(project), "--db", str(db), "--kv-dir", str(kv), "--model", str(smollm_path),
              "--max-tokens", "8", "--ctx", "2048", "--threads", "2", "--temperature", "0", "--tools", "read,list"]
    assert main(["agent", "-p", "What does calc.py do?", *common]) == 0
    first = capsys.readouterr().err
    sid = re.search(r"\[session (\w+) ", first).group(1)
    assert re.search(r"context \d+ \(0 cached\)", first)
    assert main(["agent", "-p", "Answer in one word.", "--resume", *common]) == 0   # a new engine: a restart
    second = capsys.readouterr().err
    assert f"[session {sid} " in second
    prompt, cached = map(int, re.search(r"context (\d+) \((\d+) cached\)", second).groups())
    assert cached >= 256 and prompt - cached < 200           # the conversation came from the disk tier
    with AgentStore(db) as store:
        msgs = store.messages(sid)
        assert [m.role for m in msgs][:1] == ["user"] and [m.role for m in msgs].count("user") == 2
        assert store.session(sid).kv_identity and store.session(sid).project == str(project.resolve())
    assert main(["agent", "sessions", "--db", str(db), "--project", str(project)]) == 0
    assert sid in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--project", "/no/such/folder", "-p", "x"], "--project /no/such/folder: not a folder"),
    (["--allow", "frobnicate:x", "-p", "x"], "--allow"),
    (["--max-rounds", "0", "-p", "x"], "--max-rounds 0: must be at least 1"),
    (["--temperature", "5", "-p", "x"], "--temperature 5.0"),
    (["loop", "task", "--rounds", "0"], "--rounds 0: must be at least 1"),
])
def test_bad_options_are_one_line_errors(args, message, tmp_path, capsys):
    assert main(["agent", "--db", str(tmp_path / "a.db"), *args] if args[0] != "loop"
                else ["agent", *args, "--db", str(tmp_path / "a.db")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lodestar: error: ") and message in err and "\n" not in err


def test_damaged_store_is_refused_and_kept(tmp_path, capsys):
    db = tmp_path / "agent.db"
    db.write_bytes(b"not a database at all" * 100)
    assert main(["agent", "sessions", "--db", str(db)]) == 2
    assert "damaged" in capsys.readouterr().err and db.read_bytes() == b"not a database at all" * 100


def test_real_model_completes_a_forced_tool_task_in_a_git_repo(tmp_path, smollm_path, capsys):
    """The 135M default model fills in the arguments of forced calls (write, then shell, then
    finish): the file gets the content asked for, the command runs, the turn ends."""
    import subprocess
    project = tmp_path / "repo"
    project.mkdir()
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    args = ["agent", "-p", 'Create hello.txt containing "hello world", then check it with the shell command '
            '"cat hello.txt".', "--project", str(project), "--db", str(tmp_path / "a.db"), "--kv-dir",
            str(tmp_path / "kv"), "--model", str(smollm_path), "--mode", "auto", "--tools", "write,shell",
            "--tool-choice", "required", "--tool-plan", "write,shell,finish", "--temperature", "0",
            "--max-rounds", "4", "--max-tokens", "200", "--threads", "2", "--ctx", "4096"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert (project / "hello.txt").read_text().strip() == "hello world"
    sid = re.search(r"\[session (\w+) ", err).group(1)
    with AgentStore(tmp_path / "a.db") as store:
        tools = [m for m in store.messages(sid) if m.role == "tool"]
    assert [m.name for m in tools] == ["write", "shell", "finish"]
    assert tools[0].meta["ok"] and "exit" in tools[1].content and tools[2].content == "turn finished"
    status = subprocess.run(["git", "-C", str(project), "status", "--porcelain"], capture_output=True, text=True)
    assert "?? hello.txt" in status.stdout
