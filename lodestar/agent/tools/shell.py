"""shell, job_output, job_kill: commands in the project folder.

Every command runs as ``bash -c`` in its own process group (its own session), with the
scrubbed environment and no stdin, writing stdout and stderr to one file. Stop and timeouts
kill the whole group, so a test runner's workers or a server a script started do not outlive
the call. Background commands are jobs in a ``JobTable``, read and killed by id.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from lodestar.agent.policy import Assessment, classify_shell
from lodestar.agent.tools import Tool, ToolContext, ToolResult

SHELL_MAX_CHARS = 16_000         # output the model sees; the rest stays in a spill file
SHELL_HEAD_CHARS = 6_000         # kept from the start; the end (errors, summaries) gets the rest
SHELL_MAX_TIMEOUT = 600.0
JOB_OUTPUT_MAX_CHARS = 16_000
MAX_RUNNING_JOBS = 8
KILL_GRACE_S = 2.0               # SIGTERM, then SIGKILL after this
POLL_S = 0.05                    # how often a running command checks Stop

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


# -- process groups ------------------------------------------------------------------------------
def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is in the group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    # killpg succeeds on zombies that no init has reaped yet: look at the states
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def kill_groups(groups: list[tuple[int, subprocess.Popen | None]], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM each process group, wait up to ``grace`` for all to end, SIGKILL what is left."""
    for pgid, _ in groups:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    pending = list(groups)
    while pending and time.monotonic() < deadline:
        for _, leader in pending:
            if leader is not None:
                leader.poll()                  # reap the leader so it does not count as alive
        pending = [(g, p) for g, p in pending if _group_alive(g)]
        if pending:
            time.sleep(0.02)
    for pgid, _ in pending:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for _, leader in groups:
        if leader is not None:
            try:
                leader.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass


@dataclass
class Finished:
    returncode: int | None
    status: str                  # "exited" | "timeout" | "cancelled"
    seconds: float

    def status_text(self) -> str:
        if self.status == "timeout":
            return f"timed out after {self.seconds:.1f} s; its process group was killed"
        if self.status == "cancelled":
            return f"stopped by the user after {self.seconds:.1f} s; its process group was killed"
        return f"exited with code {self.returncode}"


def run_process(argv: list[str], *, cwd: str | Path, env: dict[str, str], timeout: float,
                cancel: threading.Event, out: BinaryIO) -> Finished:
    """Run ``argv`` in its own process group with stdout+stderr to ``out``; kill the group on
    timeout or cancel, and stray members (background children) once the leader has exited."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
    status = "exited"
    while True:
        try:
            proc.wait(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            pass
        if cancel.is_set():
            status = "cancelled"
            break
        if time.monotonic() - t0 > timeout:
            status = "timeout"
            break
    seconds = time.monotonic() - t0
    if status != "exited" or _group_alive(proc.pid):
        kill_groups([(proc.pid, proc)])
    return Finished(proc.returncode if status == "exited" else None, status, seconds)


def _new_spill(ctx: ToolContext, prefix: str) -> Path:
    ctx.spill_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=ctx.spill_dir, prefix=f"{prefix}-", suffix=".txt")
    os.close(fd)
    return Path(name)


def _utf8_whole(chunk: bytes) -> bytes:
    """Drop a multi-byte character cut at the end of ``chunk`` (it is read again next time)."""
    for back in range(1, min(4, len(chunk)) + 1):
        b = chunk[-back]
        if b & 0xC0 != 0x80:               # the start byte of the last character
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
            return chunk if need <= back else chunk[:-back]
    return chunk


def summarize_file(path: Path, limit: int = SHELL_MAX_CHARS, head: int = SHELL_HEAD_CHARS) -> tuple[str, bool]:
    """The output for the model: all of it when it fits (the file is then removed), else the
    head and the tail with the file's path to read the rest; (text, file kept)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= limit:
            text = strip_ansi(f.read().decode("utf-8", "replace"))
            path.unlink(missing_ok=True)
            return text, False
        first = f.read(head)
        f.seek(max(0, size - (limit - head)))
        last = f.read()
    cut = size - len(first) - len(last)
    text = (strip_ansi(first.decode("utf-8", "replace")) + f"\n... [{cut} bytes cut] ...\n"
            + strip_ansi(last.decode("utf-8", "replace")))
    return text + f"\n[full output ({size} bytes) is in {path}: read it with offset/limit]", True


def run_captured(argv: list[str], ctx: ToolContext, *, timeout: float, prefix: str,
                 limit: int = SHELL_MAX_CHARS) -> tuple[Finished, str]:
    """run_process into a spill file, then the bounded text of its output."""
    path = _new_spill(ctx, prefix)
    try:
        with open(path, "wb") as out:
            done = run_process(argv, cwd=ctx.boundary.root, env=ctx.env, timeout=timeout, cancel=ctx.cancel, out=out)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    text, _ = summarize_file(path, limit, min(SHELL_HEAD_CHARS, limit // 3))
    return done, text


# -- background jobs -----------------------------------------------------------------------------
@dataclass
class Job:
    id: str
    command: str
    proc: subprocess.Popen
    out_path: Path
    started: float
    read_offset: int = 0         # where the next job_output without offset starts
    killed: bool = False

    def status(self) -> str:
        code = self.proc.poll()
        if code is None:
            return f"running for {time.monotonic() - self.started:.0f} s"
        if self.killed:
            return "killed"
        return f"exited with code {code}"


class JobTable:
    """The background jobs of one agent session; safe to use from several threads (Stop comes
    from the UI while a tool runs in a worker)."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._count = 0

    def start(self, command: str, *, cwd: str | Path, env: dict[str, str], out_dir: Path) -> Job:
        with self._lock:
            running = [j for j in self._jobs.values() if j.proc.poll() is None]
            if len(running) >= MAX_RUNNING_JOBS:
                raise RuntimeError(f"{len(running)} background jobs are running ({', '.join(j.id for j in running)}); "
                                   "stop one with job_kill first")
            self._count += 1
            job_id = f"j{self._count}"
            out_dir.mkdir(parents=True, exist_ok=True)
            out_path = out_dir / f"job-{job_id}-{os.getpid()}-{int(time.time() * 1000)}.txt"
            with open(out_path, "wb") as out:
                proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            job = Job(job_id, command, proc, out_path, time.monotonic())
            self._jobs[job_id] = job
            return job

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
            known = ", ".join(self._jobs) or "none"
        if job is None:
            raise KeyError(f"no job {job_id!r}; jobs: {known}")
        return job

    def read(self, job_id: str, offset: int | None = None,
             limit: int = JOB_OUTPUT_MAX_CHARS) -> tuple[Job, str, int, int]:
        """(job, text, start offset, next offset) of the job's output from ``offset`` (default:
        where the previous read ended), at most ``limit`` bytes."""
        job = self.get(job_id)
        start = job.read_offset if offset is None else offset
        with open(job.out_path, "rb") as f:
            f.seek(start)
            chunk = f.read(limit)
        if len(chunk) == limit or job.proc.poll() is None:
            chunk = _utf8_whole(chunk)     # a character still being written is read next time
        end = start + len(chunk)
        job.read_offset = end
        return job, chunk.decode("utf-8", "replace"), start, end

    def kill(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.proc.poll() is None:
            job.killed = True
        kill_groups([(job.proc.pid, job.proc)])
        return job

    def kill_all(self) -> int:
        """Kill every job's process group; how many were still running."""
        with self._lock:
            jobs = list(self._jobs.values())
        running = [j for j in jobs if j.proc.poll() is None]
        for j in running:
            j.killed = True
        if jobs:
            kill_groups([(j.proc.pid, j.proc) for j in jobs if j.proc.poll() is None or _group_alive(j.proc.pid)])
        return len(running)

    def __iter__(self):
        with self._lock:
            return iter(list(self._jobs.values()))


# -- tools ---------------------------------------------------------------------------------------
class ShellTool(Tool):
    name = "shell"
    kind = "shell"
    description = (
        "Run a bash command in the project folder (no stdin, no interactive programs). Returns the exit code and "
        f"output (stdout and stderr together; long output keeps the start and end, the rest is saved to a file you "
        f"can read). timeout is in seconds (default 120, max {SHELL_MAX_TIMEOUT:.0f}). Processes left running when the "
        "command ends are stopped: for servers and watchers use background=true, then job_output and job_kill.")
    parameters = {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "bash command line"},
            "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": SHELL_MAX_TIMEOUT,
                        "description": "seconds before the command is killed"},
            "background": {"type": "boolean", "description": "start as a background job and return at once"},
        },
        "required": ["command"],
        "additionalProperties": False,
    }

    def check(self, args: dict) -> str | None:
        return None if args["command"].strip() else "command is empty"

    def assess(self, args: dict, ctx: ToolContext) -> Assessment:
        command = args["command"]
        first = command.strip().splitlines()[0] if command.strip() else ""
        more = " ..." if "\n" in command.strip() else ""
        summary = f"shell: {first[:160]}{more}" + (" (background)" if args.get("background") else "")
        return Assessment(kind="shell", risks=classify_shell(command, ctx.boundary), summary=summary)

    def execute(self, args: dict, ctx: ToolContext) -> ToolResult:
        command = args["command"]
        if not command.strip():
            return ToolResult(ok=False, content="error: command is empty")
        if args.get("background"):
            try:
                job = ctx.jobs.start(command, cwd=ctx.boundary.root, env=ctx.env, out_dir=ctx.spill_dir)
            except (RuntimeError, OSError) as e:
                return ToolResult(ok=False, content=f"error: {e}")
            return ToolResult(ok=True, content=f"started job {job.id} (pid {job.proc.pid}); its output goes to "
                              f"{job.out_path}; check it with job_output, stop it with job_kill",
                              data={"job": job.id})
        timeout = min(float(args.get("timeout", ctx.shell_timeout)), SHELL_MAX_TIMEOUT)
        try:
            done, text = run_captured(["bash", "-c", command], ctx, timeout=timeout, prefix="shell")
        except OSError as e:
            return ToolResult(ok=False, content=f"error: cannot run bash: {e}")
        body = text if text.strip() else "(no output)"
        data = {"exit_code": done.returncode, "status": done.status, "seconds": round(done.seconds, 3)}
        if done.status != "exited":
            return ToolResult(ok=False, content=f"{done.status_text()}\npartial output:\n{body}", data=data)
        return ToolResult(ok=done.returncode == 0, content=f"{body}\n[exit code: {done.returncode}]", data=data)


class JobOutputTool(Tool):
    name = "job_output"
    kind = "meta"
    description = ("New output of a background job since the last call (or from offset, in bytes) and its status "
                   "(running, or its exit code).")
    parameters = {
        "type": "object",
        "properties": {
            "job": {"type": "string", "description": "job id from shell, e.g. j1"},
            "offset": {"type": "integer", "minimum": 0, "description": "byte offset to read from"},
        },
        "required": ["job"],
        "additionalProperties": False,
    }

    def execute(self, args: dict, ctx: ToolContext) -> ToolResult:
        try:
            job, text, start, end = ctx.jobs.read(args["job"], args.get("offset"))
        except KeyError as e:
            return ToolResult(ok=False, content=f"error: {e.args[0]}")
        size = job.out_path.stat().st_size
        head = f"job {job.id}: {job.status()}"
        body = strip_ansi(text) if text else "(no new output)"
        more = f"\n[more output: call job_output with offset={end}]" if end < size else ""
        return ToolResult(ok=True, content=f"{head}\n{body}{more}",
                          data={"job": job.id, "offset": start, "next_offset": end, "running": job.proc.poll() is None})


class JobKillTool(Tool):
    name = "job_kill"
    kind = "meta"
    description = "Stop a background job (its whole process group)."
    parameters = {
        "type": "object",
        "properties": {"job": {"type": "string", "description": "job id from shell, e.g. j1"}},
        "required": ["job"],
        "additionalProperties": False,
    }

    def execute(self, args: dict, ctx: ToolContext) -> ToolResult:
        try:
            before = ctx.jobs.get(args["job"]).status()
            job = ctx.jobs.kill(args["job"])
        except KeyError as e:
            return ToolResult(ok=False, content=f"error: {e.args[0]}")
        if not before.startswith("running"):
            return ToolResult(ok=True, content=f"job {job.id} was not running ({before})", data={"job": job.id})
        return ToolResult(ok=True, content=f"job {job.id} killed", data={"job": job.id})
