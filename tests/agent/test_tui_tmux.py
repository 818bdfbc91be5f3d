"""`lodestar agent` in a real terminal: the interactive UI runs under tmux against a scripted
OpenAI-compatible server, and the test types at it (send-keys) and reads the screen
(capture-pane) as a user would: approve a write, deny a delete with a reason, stop a
streaming reply with Ctrl+C, quit with Ctrl+D."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.agent.fake_openai import Recorder, serve, slow, text, tool

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (apt-get install tmux; .ci/run installs it)")

REPO = Path(__file__).resolve().parents[2]


class Pane:
    """One tmux session on its own server socket, so the user's tmux and config stay out of it."""

    def __init__(self, socket: Path, name: str, env: dict[str, str]) -> None:
        self.socket, self.name, self.env = socket, name, env

    def tmux(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-u", "-S", str(self.socket), *args], check=False, env=self.env,
                              capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            raise AssertionError(f"tmux {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def start(self, command: list[str], cwd: Path, conf: Path, exit_file: Path) -> None:
        """Run ``command`` in a 160x50 pane; its exit status goes to ``exit_file`` (tmux's own
        pane_dead_status is not reliable: its server does not always reap the pane's process)."""
        line = f"{shlex.join(command)}; echo $? > {shlex.quote(str(exit_file))}"
        self.tmux("-f", str(conf), "new-session", "-d", "-s", self.name, "-x", "160", "-y", "50",
                  "-c", str(cwd), line)

    def screen(self) -> str:
        """The pane with its scrollback, wrapped lines joined."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", self.name)

    def type(self, line: str) -> None:
        self.tmux("send-keys", "-t", self.name, "-l", line)
        self.tmux("send-keys", "-t", self.name, "Enter")

    def key(self, key: str) -> None:
        self.tmux("send-keys", "-t", self.name, key)

    def dead(self) -> bool:
        """Whether the program in the pane has ended (remain-on-exit keeps the pane to look at)."""
        return self.tmux("list-panes", "-t", self.name, "-F", "#{pane_dead}").strip() == "1"

    def kill(self) -> None:
        subprocess.run(["tmux", "-S", str(self.socket), "kill-server"], check=False, env=self.env,
                       capture_output=True, timeout=10)


def wait_for(pane: Pane, what: str, cond: Callable[[str], bool], timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        screen = pane.screen()
        if cond(screen):
            return screen
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}; the terminal shows:\n{screen}")
        time.sleep(0.05)


def shows(*parts: str) -> Callable[[str], bool]:
    return lambda screen: all(p in screen for p in parts)


def at_prompt(screen: str) -> bool:
    """The input prompt is back and idle (not "… " for a running turn, not an approval question)."""
    rows = [r for r in screen.splitlines() if r.strip()]
    return bool(rows) and rows[-1].startswith("›")


def tool_messages(rec: Recorder, request: int) -> list[str]:
    return [m.get("content") or "" for m in rec.requests[request]["messages"] if m.get("role") == "tool"]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    (root / "src").mkdir(parents=True)
    (root / "src" / "main.py").write_text("print('hi')\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True, timeout=10)
    return root


def clean_env(home: Path) -> dict[str, str]:
    """Only what the program needs: no API keys, no user tmux or agent settings."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "TERM": "xterm-256color", "PYTHONPATH": str(REPO)}


def test_interactive_session_under_tmux(tmp_path: Path, project: Path) -> None:
    script = [
        tool("write", path="notes/hello.txt", content="hello from the agent\nsecond line\n"),
        text("Created notes/hello.txt with two lines."),
        tool("shell", command="rm -rf src"),
        text("Understood, src stays."),
        slow("Working through it"),
        text("Back at it."),
    ]
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(home)
    db = tmp_path / "agent.db"
    exit_file = tmp_path / "exit-status"
    conf = tmp_path / "tmux.conf"
    conf.write_text("set -g remain-on-exit on\nset -g history-limit 10000\n")
    pane = Pane(tmp_path / "tmux.sock", f"lodestar-{uuid.uuid4().hex[:8]}", env)
    with serve(script) as (url, rec):
        try:
            pane.start([sys.executable, "-m", "lodestar.cli", "agent", "--base-url", url, "--project", str(project),
                        "--db", str(db), "--mode", "ask"], project, conf, exit_file)
            banner = wait_for(pane, "the banner and the prompt",
                              lambda s: "lodestar agent ·" in s and at_prompt(s), timeout=15)
            session_id = re.search(r"session (\S+)", banner).group(1)

            # a. a write is asked about, approved with y, and its diff, the reply and the stats show
            pane.type("create notes/hello.txt")
            wait_for(pane, "the approval question",
                     shows("? approve write notes/hello.txt (new file, 2 lines)", "allow? [y/n]"))
            assert not (project / "notes").exists(), "the file was written before the approval"
            pane.type("y")
            screen = wait_for(pane, "the reply and the stats line",
                              shows("Created notes/hello.txt with two lines.", "2 model calls · 1 tool · "))
            assert (project / "notes" / "hello.txt").read_text() == "hello from the agent\nsecond line\n"
            assert "+hello from the agent" in screen and "+second line" in screen, "the diff is not shown"
            assert at_prompt(wait_for(pane, "the prompt after turn a", at_prompt))

            # b. a delete is denied with a reason; the model is told both
            pane.type("clean up the sources")
            wait_for(pane, "the approval of rm -rf",
                     lambda s: "? approve shell: rm -rf src" in s and s.rstrip().endswith("allow? [y/n]"))
            pane.type("n do not delete")
            wait_for(pane, "the reply after the denial",
                     shows("Understood, src stays.", "2 model calls · 0 tools · "))
            assert (project / "src" / "main.py").exists(), "src/ was deleted despite the denial"
            told = tool_messages(rec, 3)
            assert told and "denied" in told[-1] and "do not delete" in told[-1], told

            # c. Ctrl+C stops a streaming reply: the stream is closed, the text that came stays on
            # screen (also the line still open), and the prompt returns
            wait_for(pane, "the prompt after turn b", at_prompt)
            pane.type("explain everything slowly")
            wait_for(pane, "the slow reply streaming", shows("Working through it"))
            deadline = time.monotonic() + 3
            while "." not in rec.streamed.get(4, ""):
                assert time.monotonic() < deadline, "the slow reply did not stream"
                time.sleep(0.02)
            pane.key("C-c")
            screen = wait_for(pane, "the stopped run and the prompt",
                              lambda s: "stopped · " in s and at_prompt(s), timeout=3)
            deadline = time.monotonic() + 3
            while rec.closed_early == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert rec.closed_early == 1, "the model's stream was not closed by Ctrl+C"
            rows = screen.splitlines()
            stopped_at = next(i for i, r in enumerate(rows) if r.startswith("stopped · "))
            cut = rows[rows.index("Working through it") + 1:stopped_at]
            assert any(re.fullmatch(r"\.+", r) for r in cut), f"the unfinished line of the stopped reply is lost: {cut}"
            pane.type("go on")
            screen = wait_for(pane, "the reply after the stop", shows("1 model call · 0 tools · "))
            assert "Back at it." in screen.splitlines(), "the next reply is not on a line of its own"

            # d. Ctrl+D quits cleanly and the session is stored
            pane.key("C-d")
            deadline = time.monotonic() + 5
            while not (pane.dead() and exit_file.exists() and exit_file.read_text().strip()):
                assert time.monotonic() < deadline, f"Ctrl+D did not quit; the terminal shows:\n{pane.screen()}"
                time.sleep(0.05)
            status = exit_file.read_text().strip()
            assert status == "0", f"the agent exited with {status}:\n{pane.screen()}"
        finally:
            pane.kill()
    listed = subprocess.run([sys.executable, "-m", "lodestar.cli", "agent", "sessions", "--db", str(db),
                             "--project", str(project)], check=False, env=env, capture_output=True, text=True,
                            timeout=30)
    assert listed.returncode == 0, listed.stderr
    assert session_id in listed.stdout and "create notes/hello.txt" in listed.stdout, listed.stdout
