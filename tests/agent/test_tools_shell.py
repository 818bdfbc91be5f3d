import threading
import time
from pathlib import Path

import pytest

from lodestar.agent.policy import scrubbed_env
from lodestar.agent.tools import TOOLS, ToolResult, new_context, validate_call
from lodestar.agent.tools.shell import SHELL_MAX_CHARS


@pytest.fixture
def ctx(tmp_path: Path):
    root = tmp_path / "proj"
    root.mkdir()
    c = new_context(root, tmp_path / "spill")
    yield c
    c.jobs.kill_all()


def call(ctx, name: str, **args) -> ToolResult:
    checked = validate_call(name, args)
    assert not isinstance(checked, ToolResult), checked.content
    tool, args = checked
    return tool.run(args, ctx)


def alive(pid: int) -> bool:
    """A live process (a zombie no one reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_until(predicate, seconds: float = 3.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_shell_runs_in_the_project_and_reports_the_exit_code(ctx):
    r = call(ctx, "shell", command="pwd; echo err >&2; exit 3")
    assert not r.ok
    assert str(ctx.boundary.root) in r.content and "err" in r.content and "[exit code: 3]" in r.content
    assert r.data["exit_code"] == 3
    r = call(ctx, "shell", command="echo ok")
    assert r.ok and r.content.startswith("ok") and "[exit code: 0]" in r.content


def test_shell_has_no_stdin(ctx):
    r = call(ctx, "shell", command="cat; echo done", timeout=5)
    assert r.ok and "done" in r.content


def test_timeout_kills_child_and_grandchild(ctx):
    pidfile = ctx.boundary.root / "pid"
    t0 = time.monotonic()
    r = call(ctx, "shell", command=f"bash -c 'sleep 30 & echo $! > {pidfile}; wait' & wait", timeout=0.5)
    assert time.monotonic() - t0 < 4
    assert not r.ok and "timed out" in r.content and "killed" in r.content
    grandchild = int(pidfile.read_text())
    assert wait_until(lambda: not alive(grandchild), 2.0), "the grandchild survived the timeout"


def test_cancel_stops_a_long_command_promptly(ctx):
    threading.Timer(0.3, ctx.cancel.set).start()
    t0 = time.monotonic()
    r = call(ctx, "shell", command="echo started; sleep 30")
    assert time.monotonic() - t0 < 1.5
    assert not r.ok and "stopped by the user" in r.content and "started" in r.content


def test_stray_background_processes_end_with_the_command(ctx):
    pidfile = ctx.boundary.root / "pid"
    r = call(ctx, "shell", command=f"sleep 30 & echo $! > {pidfile}; echo left")
    assert r.ok and "left" in r.content
    assert wait_until(lambda: not alive(int(pidfile.read_text())), 3.0)


def test_env_is_scrubbed(ctx, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    monkeypatch.setenv("GITHUB_TOKEN", "ghp-should-not-leak")
    fresh = new_context(ctx.boundary.root, ctx.spill_dir)
    r = call(fresh, "shell", command="env")
    assert r.ok and "PATH=" in r.content
    assert "OPENAI_API_KEY" not in r.content and "should-not-leak" not in r.content
    ctx.env = scrubbed_env({"PATH": "/usr/bin:/bin", "OPENAI_API_KEY": "sk-x"})
    assert "sk-x" not in call(ctx, "shell", command="env").content


def test_long_output_is_bounded_and_spilled_to_a_readable_file(ctx):
    r = call(ctx, "shell", command="for i in $(seq 1 20000); do echo line-$i; done")
    assert r.ok and len(r.content) < SHELL_MAX_CHARS + 500
    assert "line-1\n" in r.content and "line-20000" in r.content and "bytes cut" in r.content
    path = r.content.split("full output (")[1].split(" is in ")[1].split(":")[0]
    assert Path(path).parent == ctx.spill_dir
    full = call(ctx, "read", path=path, offset=10000, limit=1)
    assert full.ok and "line-10000" in full.content
    # short output leaves no spill file behind
    before = set(ctx.spill_dir.iterdir())
    call(ctx, "shell", command="echo short")
    assert set(ctx.spill_dir.iterdir()) == before


def test_ansi_colours_are_stripped(ctx):
    r = call(ctx, "shell", command=r"printf '\033[31mred\033[0m\n'")
    assert "red" in r.content and "\x1b" not in r.content


def test_background_job_output_and_kill(ctx):
    r = call(ctx, "shell", command="echo one; sleep 0.2; echo two; sleep 30", background=True)
    assert r.ok and r.data["job"] == "j1"
    job = ctx.jobs.get("j1")
    assert wait_until(lambda: "two" in job.out_path.read_text())
    out = call(ctx, "job_output", job="j1")
    assert out.ok and "running" in out.content and "one" in out.content and "two" in out.content
    again = call(ctx, "job_output", job="j1")
    assert "(no new output)" in again.content                          # continues where the last read ended
    assert "one" in call(ctx, "job_output", job="j1", offset=0).content  # an explicit offset rereads
    killed = call(ctx, "job_kill", job="j1")
    assert killed.ok and "killed" in killed.content
    assert not alive(job.proc.pid)
    assert "killed" in call(ctx, "job_output", job="j1").content
    assert not call(ctx, "job_kill", job="j9").ok


def test_finished_job_reports_its_exit_code(ctx):
    call(ctx, "shell", command="echo done; exit 4", background=True)
    job = ctx.jobs.get("j1")
    assert wait_until(lambda: job.proc.poll() is not None)
    out = call(ctx, "job_output", job="j1")
    assert "exited with code 4" in out.content and "done" in out.content


def test_kill_all_stops_every_job(ctx):
    for _ in range(2):
        call(ctx, "shell", command="sleep 30", background=True)
    jobs = list(ctx.jobs)
    t0 = time.monotonic()
    assert ctx.jobs.kill_all() == 2
    assert time.monotonic() - t0 < 2.5
    assert all(not alive(j.proc.pid) for j in jobs)


def test_shell_assessment_carries_risks(ctx):
    a = TOOLS["shell"].assess({"command": "rm -rf build"}, ctx)
    assert a.kind == "shell" and a.risks == {"destructive"} and a.summary == "shell: rm -rf build"
    assert TOOLS["shell"].assess({"command": "pytest", "background": True}, ctx).summary.endswith("(background)")


def test_shell_rejects_bad_timeouts_and_empty_commands(ctx):
    for args in ({"command": "ls", "timeout": 601}, {"command": "ls", "timeout": 0}, {"command": "  "}):
        r = validate_call("shell", args)
        assert isinstance(r, ToolResult) and not r.ok
