"""grep: regex search over the project's files.

ripgrep (``rg``) does the work when it is on PATH; otherwise a Python search over the same
files (git's view of the tree, no binary files, none over 2 MB). Both backends produce the
same stream of (path, line, text, is-match) events and one formatter writes them, so the
model sees the same ``path:line:text`` lines whichever ran.
"""
from __future__ import annotations

import base64
import json
import os
import re
import selectors
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from lodestar.agent.policy import Assessment
from lodestar.agent.tools import Tool, ToolContext, ToolResult, path_assessment
from lodestar.agent.tools.files import _error, _resolve, glob_regex, project_files

GREP_MAX_MATCHES = 200           # match lines shown
GREP_MAX_CHARS = 24_000
GREP_COUNT_LIMIT = 5_000         # matches counted before the search stops ("more than N")
GREP_LINE_CHARS = 300
GREP_MAX_FILE_BYTES = 2 << 20


class PatternError(ValueError):
    """ripgrep rejected the pattern (or the search); its message says why."""


@dataclass(frozen=True)
class Hit:
    path: str                    # relative to the project root
    line: int
    text: str
    match: bool                  # False: a context line


@dataclass
class Collected:
    hits: list[Hit] = field(default_factory=list)
    matches: int = 0             # counted, up to GREP_COUNT_LIMIT

    def add(self, hit: Hit) -> bool:
        """Take one event; False once enough has been counted and the search can stop."""
        if hit.match:
            self.matches += 1
        # keep lines until the first match that will not be shown; after it only count
        if self.matches <= GREP_MAX_MATCHES:
            self.hits.append(hit)
        return self.matches < GREP_COUNT_LIMIT


def format_hits(found: Collected, context: int) -> str:
    """``path:line:text`` for matches, ``path-line-text`` for context, ``--`` between groups."""
    out: list[str] = []
    used = 0
    shown = 0
    last: Hit | None = None
    last_match: Hit | None = None
    for hit in found.hits:
        if hit.match and shown >= GREP_MAX_MATCHES:
            break
        # context lines past the last shown match belong to a match that is not shown
        if not hit.match and shown >= GREP_MAX_MATCHES and last_match is not None and \
                (hit.path != last_match.path or hit.line > last_match.line + context):
            break
        text = hit.text if len(hit.text) <= GREP_LINE_CHARS else hit.text[:GREP_LINE_CHARS] + " ..."
        line = f"{hit.path}{':' if hit.match else '-'}{hit.line}{':' if hit.match else '-'}{text}"
        sep = context > 0 and last is not None and (hit.path != last.path or hit.line != last.line + 1)
        cost = len(line) + 1 + (3 if sep else 0)
        if used + cost > GREP_MAX_CHARS and out:
            break
        if sep:
            out.append("--")
        out.append(line)
        used += cost
        last = hit
        if hit.match:
            shown += 1
            last_match = hit
    text = "\n".join(out)
    rest = found.matches - shown
    if rest > 0:
        more = f"more than {rest}" if found.matches >= GREP_COUNT_LIMIT else str(rest)
        text += f"\n[{more} more matches not shown; narrow the pattern, path or glob]"
    return text


# -- backends ------------------------------------------------------------------------------------
def _glob_filter(glob: str | None):
    """rg --glob semantics: without '/', the file name at any depth; with '/', the path from the
    project root; a leading '!' excludes."""
    if not glob:
        return lambda rel: True
    negate = glob.startswith("!")
    pattern = glob[1:] if negate else glob
    regex = glob_regex(pattern.lstrip("/"))
    by_name = "/" not in pattern

    def keep(rel: str) -> bool:
        hit = bool(regex.match(rel.rsplit("/", 1)[-1] if by_name else rel))
        return hit != negate
    return keep


def python_search(ctx: ToolContext, base: Path, pattern: str, *, ignore_case: bool, context: int,
                  glob: str | None) -> Iterator[Hit]:
    """Search the files under ``base`` (or the one file) with Python's re."""
    regex = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
    keep = _glob_filter(glob)
    files = project_files(base, ctx.cancel) if base.is_dir() else [base]
    for path in files:
        if ctx.cancel.is_set():
            return
        rel = ctx.boundary.relative(path)
        if base.is_dir() and not keep(rel):
            continue
        try:
            if path.stat().st_size > GREP_MAX_FILE_BYTES:
                continue
            data = path.read_bytes()
        except OSError:
            continue
        if b"\0" in data:
            continue
        lines = data.decode("utf-8", "replace").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        hits = [i for i, ln in enumerate(lines) if regex.search(ln)]
        if not hits:
            continue
        wanted: set[int] = set()
        for i in hits:
            wanted.update(range(max(0, i - context), min(len(lines), i + context + 1)))
        matched = set(hits)
        for i in sorted(wanted):
            yield Hit(rel, i + 1, lines[i].rstrip("\r"), i in matched)


def _rg_text(obj: dict) -> str:
    if "text" in obj:
        return obj["text"]
    return os.fsdecode(base64.b64decode(obj.get("bytes", "")))


def rg_search(ctx: ToolContext, base: Path, pattern: str, *, ignore_case: bool, context: int,
              glob: str | None, rg: str) -> Iterator[Hit]:
    """Search with ripgrep's JSON output; raises PatternError with rg's message on a bad pattern."""
    rel = ctx.boundary.relative(base)
    target = "./" if rel == "." else rel
    cmd = [rg, "--json", "--hidden", "--glob", "!.git", "--max-filesize", "2M", "--sort", "path",
           "--no-config", "-e", pattern]
    if ignore_case:
        cmd.append("-i")
    if context:
        cmd += ["-C", str(context)]
    if glob:
        cmd += ["--glob", glob]
    cmd += ["--", target]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, cwd=ctx.boundary.root, stdout=subprocess.PIPE, stderr=err,
                                stdin=subprocess.DEVNULL, env=ctx.env)
        produced = False
        try:
            for raw in _lines(proc, ctx):
                try:
                    event = json.loads(raw)
                except ValueError:
                    continue
                if event.get("type") not in ("match", "context"):
                    continue
                data = event["data"]
                path = _rg_text(data["path"])
                path = path[2:] if path.startswith("./") else path
                text = _rg_text(data["lines"]).rstrip("\n").rstrip("\r")
                produced = True
                yield Hit(path, data["line_number"], text, event["type"] == "match")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if proc.returncode == 2 and not produced:
            err.seek(0)
            message = err.read().decode("utf-8", "replace").strip()
            if message:
                raise PatternError(message[-500:])


def _lines(proc: subprocess.Popen, ctx: ToolContext) -> Iterator[bytes]:
    """stdout lines of ``proc``, checking ctx.cancel every 50 ms even while it prints nothing."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            if ctx.cancel.is_set():
                return
            if not sel.select(0.05):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            buf += chunk
            *complete, buf = buf.split(b"\n")
            yield from complete
    if buf:
        yield buf


def _hard_linked(ctx: ToolContext, rel: str, seen: dict[str, int]) -> bool:
    """Whether the file (relative to the root) has more than one hard link; ``seen`` caches."""
    if rel not in seen:
        try:
            st = os.stat(ctx.boundary.root / rel)
            seen[rel] = st.st_nlink if stat.S_ISREG(st.st_mode) else 1
        except OSError:
            seen[rel] = 1
    return seen[rel] > 1


class GrepTool(Tool):
    name = "grep"
    kind = "read"
    description = (
        "Search file contents with a regular expression; prints 'path:line:text' (context lines 'path-line-text'). "
        "Searches the project (or path, a folder or file), skipping .git, files git ignores, binary files and files "
        f"over 2 MB. glob filters files ('*.py', 'src/**/*.ts'). At most {GREP_MAX_MATCHES} matches are shown.")
    parameters = {
        "type": "object",
        "properties": {
            "pattern": {"type": "string", "description": "regular expression"},
            "path": {"type": "string", "description": "folder or file to search (default '.')"},
            "glob": {"type": "string", "description": "only files matching this glob"},
            "ignore_case": {"type": "boolean", "description": "case-insensitive (default false)"},
            "context": {"type": "integer", "minimum": 0, "maximum": 5,
                        "description": "lines of context around matches"},
        },
        "required": ["pattern"],
        "additionalProperties": False,
    }

    def __init__(self, use_rg: bool | None = None) -> None:
        self.use_rg = use_rg          # None: ripgrep when it is on PATH

    def assess(self, args: dict, ctx: ToolContext) -> Assessment:
        return path_assessment("read", args.get("path", "."), ctx, f"grep {args['pattern']!r}")

    def execute(self, args: dict, ctx: ToolContext) -> ToolResult:
        base = _resolve(ctx, args.get("path", "."))
        if isinstance(base, ToolResult):
            return base
        if not base.exists():
            return _error(f"no such file or folder: {ctx.boundary.relative(base)}")
        rg = shutil.which("rg", path=ctx.env.get("PATH")) if self.use_rg is not False else None
        if self.use_rg and rg is None:
            return _error("ripgrep (rg) is not on PATH")
        options = dict(ignore_case=args.get("ignore_case", False), context=args.get("context", 0),
                       glob=args.get("glob"))
        try:
            if rg:
                events = rg_search(ctx, base, args["pattern"], rg=rg, **options)
            else:
                events = python_search(ctx, base, args["pattern"], **options)
            found = Collected()
            links: dict[str, int] = {}
            for hit in events:
                if _hard_linked(ctx, hit.path, links):
                    continue                # read refuses it too: another link may be outside
                if not found.add(hit):
                    break
        except (re.error, PatternError) as e:
            return _error(f"bad pattern {args['pattern']!r}: {e}")
        text = format_hits(found, options["context"])
        if ctx.cancel.is_set():
            return ToolResult(ok=False, content="stopped by the user; partial results:\n" + text)
        if not found.matches:
            return ToolResult(ok=True, content=f"no matches for {args['pattern']!r} in {ctx.boundary.relative(base)}")
        return ToolResult(ok=True, content=text, data={"matches": found.matches, "backend": "rg" if rg else "python"})
