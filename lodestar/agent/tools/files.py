"""File tools: read, write, edit, list and glob, all inside the project boundary.

Also the project's file listing shared with grep (``project_files``: git's view of the tree,
so ignored build output stays out, or a plain walk outside git) and glob patterns
(``glob_regex``).
"""
from __future__ import annotations

import difflib
import mimetypes
import os
import re
import subprocess
import tempfile
import threading
from pathlib import Path

from lodestar.agent.policy import Assessment, BoundaryError, scrubbed_env
from lodestar.agent.tools import Tool, ToolContext, ToolResult, clip, path_assessment

READ_MAX_CHARS = 24_000          # one read result, numbered lines included
READ_DEFAULT_LINES = 400
LINE_MAX_CHARS = 2_000           # minified files: one line must not fill the whole result
COUNT_LINES_MAX_BYTES = 64 << 20 # past this, a read does not scan to the end to count lines
LIST_MAX_ENTRIES = 400
GLOB_MAX_RESULTS = 200
DIFF_MAX_CHARS = 200_000         # display/data copy of a diff
EDIT_DIFF_CHARS = 4_000          # the diff the model sees after an edit
DIFF_SOURCE_MAX_BYTES = 8 << 20  # larger files get no diff (difflib is quadratic in the worst case)

_MAGIC = (
    (b"\x89PNG", "PNG image"), (b"\xff\xd8\xff", "JPEG image"), (b"GIF8", "GIF image"), (b"%PDF", "PDF document"),
    (b"PK\x03\x04", "zip archive"), (b"\x1f\x8b", "gzip archive"), (b"\x7fELF", "ELF executable"),
    (b"SQLite format 3", "SQLite database"), (b"GGUF", "GGUF model"), (b"\x00asm", "WebAssembly module"),
    (b"BZh", "bzip2 archive"), (b"\xfd7zXZ", "xz archive"), (b"7z\xbc\xaf", "7z archive"),
    (b"MZ", "Windows executable"),
    (b"\xcf\xfa\xed\xfe", "Mach-O executable"), (b"\x93NUMPY", "NumPy array"), (b"RIFF", "RIFF media"),
)


def binary_kind(path: Path) -> str | None:
    """A description of the file's type when it is binary (a NUL byte near its start), else None."""
    with open(path, "rb") as f:
        head = f.read(8192)
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if b"\x00" not in head:
        return None
    guess, _ = mimetypes.guess_type(path.name)
    return guess or "binary data"


def _human(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def _error(message: str) -> ToolResult:
    return ToolResult(ok=False, content=f"error: {message}")


def _resolve(ctx: ToolContext, path: str, *, write: bool = False) -> Path | ToolResult:
    try:
        return ctx.boundary.resolve(path, write=write)
    except BoundaryError as e:
        return _error(str(e))


def _missing(ctx: ToolContext, path: Path) -> ToolResult:
    """A not-found error that names similar files in the nearest existing folder."""
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    try:
        names = os.listdir(parent)
    except OSError:
        names = []
    close = difflib.get_close_matches(path.name, names, n=3, cutoff=0.6)
    hint = f"; similar: {', '.join(ctx.boundary.relative(parent / n) for n in close)}" if close else ""
    return _error(f"no such file: {ctx.boundary.relative(path)}{hint}")


# -- read ----------------------------------------------------------------------------------------
class ReadTool(Tool):
    name = "read"
    kind = "read"
    description = (
        "Read a text file of the project (or a spilled output file) as numbered lines 'N<TAB>text'. "
        f"Returns at most {READ_DEFAULT_LINES} lines by default and about {READ_MAX_CHARS // 1000} KB; when the "
        "result is cut it ends with the offset to continue from. Binary files are refused.")
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "file path, relative to the project root"},
            "offset": {"type": "integer", "minimum": 1, "description": "first line to return (1-based)"},
            "limit": {"type": "integer", "minimum": 1,
                      "description": f"number of lines (default {READ_DEFAULT_LINES})"},
        },
        "required": ["path"],
        "additionalProperties": False,
    }

    def assess(self, args: dict, ctx: ToolContext) -> Assessment:
        return path_assessment("read", args["path"], ctx, f"read {args['path']}")

    def execute(self, args: dict, ctx: ToolContext) -> ToolResult:
        path = _resolve(ctx, args["path"])
        if isinstance(path, ToolResult):
            return path
        if path.is_dir():
            return _error(f"{ctx.boundary.relative(path)} is a folder: use list or glob")
        if not path.exists():
            return _missing(ctx, path)
        size = path.stat().st_size
        kind = binary_kind(path)
        if kind:
            return _error(f"{ctx.boundary.relative(path)} is a binary file ({size} bytes, {kind}); not shown")
        offset = args.get("offset", 1)
        limit = args.get("limit", READ_DEFAULT_LINES)
        out: list[str] = []
        used = 0
        last = offset - 1                # last line shown
        total = 0
        full = True                      # every requested line fit in the budget
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                total = n
                if n < offset:
                    continue
                if n >= offset + limit or not full:
                    if size > COUNT_LINES_MAX_BYTES:
                        total = -1       # not worth scanning gigabytes to count lines
                        break
                    continue
                text = raw.decode("utf-8", "replace").rstrip("\n").rstrip("\r")
                if len(text) > LINE_MAX_CHARS:
                    text = f"{text[:LINE_MAX_CHARS]} ... [{len(text) - LINE_MAX_CHARS} more characters on this line]"
                line = f"{n:>6}\t{text}\n"
                if out and used + len(line) > READ_MAX_CHARS:
                    full = False
                    continue
                out.append(line)
                used += len(line)
                last = n
        if total == 0:
            return ToolResult(ok=True, content=f"({ctx.boundary.relative(path)} is empty)")
        if offset > total > 0:
            return _error(f"offset {offset} is past the end of {ctx.boundary.relative(path)} ({total} lines)")
        body = "".join(out)
        if last < total or total < 0:
            of = "?" if total < 0 else str(total)
            body += f"[lines {offset}-{last} of {of} shown; continue with offset={last + 1}]"
        return ToolResult(ok=True, content=body, data={"path": ctx.boundary.relative(path), "lines": [offset, last]})


# -- write and edit ------------------------------------------------------------------------------
def unified_diff(old: str, new: str, rel: str, created: bool = False) -> tuple[str, int, int]:
    """(diff text, lines added, lines removed)."""
    if max(len(old), len(new)) > DIFF_SOURCE_MAX_BYTES:
        return (f"(no diff: file larger than {DIFF_SOURCE_MAX_BYTES >> 20} MB)",
                new.count("\n"), old.count("\n"))
    lines = list(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                      fromfile="/dev/null" if created else f"a/{rel}", tofile=f"b/{rel}"))
    added = sum(1 for ln in lines if ln.startswith("+") and not ln.startswith("+++"))
    removed = sum(1 for ln in lines if ln.startswith("-") and not ln.startswith("---"))
    text = "".join(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n" for ln in lines)
    return text, added, removed


def _read_text(path: Path) -> str:
    # surrogateescape: bytes that are not UTF-8 survive a read/write round trip unchanged
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        return f.read()


def _write_text(path: Path, text: str) -> None:
    """Write the file; an existing one is replaced atomically, keeping its permissions (an
    executable script stays one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        with open(path, "x", encoding="utf-8", errors="surrogateescape", newline="") as f:
            f.write(text)
        return
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape", newline="") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _line_count(text: str) -> int:
    return text.count("\n") + (1 if text and not text.endswith("\n") else 0)


class WriteTool(Tool):
    name = "write"
    kind = "write"
    description = ("Create or overwrite a file inside the project with the given content (folders are created). "
                   "Prefer edit for changing part of an existing file.")
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "file path, relative to the project root"},
            "content": {"type": "string", "description": "the complete new content of the file"},
        },
        "required": ["path", "content"],
        "additionalProperties": False,
    }

    def _old(self, path: Path) -> str | None:
        """The current text, "" for a new file, None when the diff cannot be shown (binary)."""
        if not path.exists():
            return ""
        if path.is_dir() or binary_kind(path):
            return None
        return _read_text(path)

    def assess(self, args: dict, ctx: ToolContext) -> Assessment:
        base = path_assessment("write", args["path"], ctx, f"write {args['path']}", write=True)
        if base.refused:
            return base
        path = ctx.boundary.resolve(args["path"], write=True)
        try:
            old = self._old(path)
        except OSError as e:
            return Assessment(kind="write", summary=f"write {base.target} (unreadable: {e.strerror})",
                              target=base.target)
        if path.is_dir():
            change = "a folder: will fail"
        elif old is None:
            change = "replaces a binary file"
        elif not path.exists():
            change = f"new file, {_line_count(args['content'])} lines"
        else:
            _, added, removed = unified_diff(old, args["content"], base.target or "")
            change = f"+{added} -{removed}"
        return Assessment(kind="write", summary=f"write {base.target} ({change})", target=base.target)

    def execute(self, args: dict, ctx: ToolContext) -> ToolResult:
        path = _resolve(ctx, args["path"], write=True)
        if isinstance(path, ToolResult):
            return path
        rel = ctx.boundary.relative(path)
        if path.is_dir():
            return _error(f"{rel} is a folder; give a file path")
        created = not path.exists()
        old = self._old(path)
        content = args["content"]
        try:
            _write_text(path, content)
        except OSError as e:
            return _error(f"cannot write {rel}: {e.strerror or e}")
        diff, added, removed = unified_diff(old or "", content, rel, created) if old is not None else ("", 0, 0)
        change = "new file" if created else (f"+{added} -{removed}" if old is not None else "replaced a binary file")
        return ToolResult(ok=True, content=f"wrote {rel}: {_line_count(content)} lines ({change})",
                          display=clip(diff, DIFF_MAX_CHARS)[0] or None,
                          data={"path": rel, "diff": clip(diff, DIFF_MAX_CHARS)[0], "created": created})


class EditError(Exception):
    """An edit that cannot be applied; the message tells the model how to fix it."""


def apply_edits(text: str, edits: list[dict]) -> tuple[str, int]:
    """Apply exact-string replacements in order to ``text``: (new text, replacements made).
    Raises EditError naming the failing edit; the caller writes nothing in that case."""
    count = 0
    for i, edit in enumerate(edits, 1):
        which = f"edit {i} of {len(edits)}: " if len(edits) > 1 else ""
        old, new = edit["old"], edit["new"]
        n = text.count(old)
        if n == 0 and "\r\n" in text and "\n" in old and "\r\n" not in old:
            old, new = old.replace("\n", "\r\n"), new.replace("\n", "\r\n")   # the file uses CRLF
            n = text.count(old)
        if n == 0:
            raise EditError(which + _no_match_hint(text, old))
        if n > 1 and not edit.get("replace_all", False):
            lines = []
            start = 0
            while (pos := text.find(old, start)) >= 0:
                lines.append(text.count("\n", 0, pos) + 1)
                start = pos + max(1, len(old))
            shown = ", ".join(map(str, lines[:20])) + (", ..." if len(lines) > 20 else "")
            raise EditError(f"{which}old text matches {n} times (lines {shown}); include more surrounding "
                            "lines to make it unique, or set replace_all")
        text = text.replace(old, new)
        count += n
    return text, count


def _no_match_hint(text: str, old: str) -> str:
    message = "old text not found in the file"
    if re.match(r"\s*\d+\t", old):
        return message + "; it seems to include line numbers from read: leave the 'N<TAB>' prefixes out"
    if " ".join(old.split()) and " ".join(old.split()) in " ".join(text.split()):
        message += "; it matches if whitespace is ignored: copy indentation and line breaks exactly"
    target = next((ln.strip() for ln in old.splitlines() if ln.strip()), "")
    lines = text.splitlines()
    stripped = [ln.strip() for ln in lines]
    close = difflib.get_close_matches(target, stripped, n=3, cutoff=0.5) if target else []
    if close:
        shown = []
        for match in close:
            n = stripped.index(match)
            shown.append(f"{n + 1}: {lines[n][:200]}")
        message += "; closest lines:\n" + "\n".join(shown)
    return message


class EditTool(Tool):
    name = "edit"
    kind = "write"
    description = (
        "Replace exact text in an existing file. Give old (copied exactly from the file, without read's line "
        "numbers, with enough surrounding lines to be unique) and new; or edits: a list of {old, new} applied "
        "in order, all or nothing. replace_all replaces every occurrence of old.")
    parameters = {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "file path, relative to the project root"},
            "old": {"type": "string", "description": "exact text to replace"},
            "new": {"type": "string", "description": "replacement text"},
            "replace_all": {"type": "boolean", "description": "replace every occurrence (default false)"},
            "edits": {
                "type": "array", "minItems": 1, "description": "several replacements, applied in order",
                "items": {"type": "object", "properties": {"old": {"type": "string"}, "new": {"type": "string"}},
                          "required": ["old", "new"], "additionalProperties": False},
            },
        },
        "required": ["path"],
        "additionalProperties": False,
    }

    def check(self, args: dict) -> str | None:
        single = "old" in args or "new" in args
        if single and "edits" in args:
            return "give either old and new, or edits, not both"
        if not single and "edits" not in args:
            return "give old and new (or edits)"
        if single and not ("old" in args and "new" in args):
            return "old and new go together"
        if "edits" in args and "replace_all" in args:
            return "replace_all applies to old/new, not to edits"
        for edit in self._edits(args):
            if edit["old"] == "":
                return "old is empty; to create or overwrite a whole file use write"
            if edit["old"] == edit["new"]:
                return "old and new are identical"
        return None

    @staticmethod
    def _edits(args: dict) -> list[dict]:
        if "edits" in args:
            return list(args["edits"])
        return [{"old": args["old"], "new": args["new"], "replace_all": args.get("replace_all", False)}]

    def assess(self, args: dict, ctx: ToolContext) -> Assessment:
        base = path_assessment("write", args["path"], ctx, f"edit {args['path']}", write=True)
        if base.refused:
            return base
        path = ctx.boundary.resolve(args["path"], write=True)
        summary = f"edit {base.target}"
        try:
            old = _read_text(path)
            new, _ = apply_edits(old, self._edits(args))
            _, added, removed = unified_diff(old, new, base.target or "")
            summary += f" (+{added} -{removed})"
        except (OSError, EditError):
            summary += " (will fail: see the result)"
        return Assessment(kind="write", summary=summary, target=base.target)

    def execute(self, args: dict, ctx: ToolContext) -> ToolResult:
        problem = self.check(args)
        if problem:
            return _error(problem)
        path = _resolve(ctx, args["path"], write=True)
        if isinstance(path, ToolResult):
            return path
        rel = ctx.boundary.relative(path)
        if path.is_dir():
            return _error(f"{rel} is a folder; give a file path")
        if not path.exists():
            return _missing(ctx, path)
        if binary_kind(path):
            return _error(f"{rel} is a binary file; it cannot be edited")
        old = _read_text(path)
        try:
            new, count = apply_edits(old, self._edits(args))
        except EditError as e:
            return _error(f"{rel} unchanged: {e}")
        try:
            _write_text(path, new)
        except OSError as e:
            return _error(f"cannot write {rel}: {e.strerror or e}")
        diff, added, removed = unified_diff(old, new, rel)
        shown, _ = clip(diff, EDIT_DIFF_CHARS)
        plural = "s" if count != 1 else ""
        return ToolResult(ok=True, content=f"edited {rel}: {count} replacement{plural} (+{added} -{removed})\n{shown}",
                          display=clip(diff, DIFF_MAX_CHARS)[0],
                          data={"path": rel, "diff": clip(diff, DIFF_MAX_CHARS)[0], "replacements": count})


# -- list and glob -------------------------------------------------------------------------------
class ListTool(Tool):
    name = "list"
    kind = "read"
    description = (f"List one folder (not recursive): folders end with '/', files show their size. At most "
                   f"{LIST_MAX_ENTRIES} entries; use glob to search deeper.")
    parameters = {
        "type": "object",
        "properties": {"path": {"type": "string", "description": "folder, relative to the project root (default '.')"}},
        "required": [],
        "additionalProperties": False,
    }

    def assess(self, args: dict, ctx: ToolContext) -> Assessment:
        return path_assessment("read", args.get("path", "."), ctx, f"list {args.get('path', '.')}")

    def execute(self, args: dict, ctx: ToolContext) -> ToolResult:
        path = _resolve(ctx, args.get("path", "."))
        if isinstance(path, ToolResult):
            return path
        rel = ctx.boundary.relative(path)
        if not path.exists():
            return _missing(ctx, path)
        if not path.is_dir():
            return _error(f"{rel} is a file, not a folder: use read")
        try:
            entries = list(os.scandir(path))
        except OSError as e:
            return _error(f"cannot list {rel}: {e.strerror}")
        dirs, files = [], []
        for e in entries:
            if e.is_symlink():
                files.append(f"{e.name} -> {os.readlink(e.path)}")
            elif e.is_dir():
                dirs.append(f"{e.name}/")
            elif e.is_file():
                files.append(f"{e.name}  {_human(e.stat().st_size)}")
            else:
                files.append(f"{e.name}  (special file)")
        dirs.sort(key=str.lower)
        files.sort(key=str.lower)
        lines = dirs + files
        head = f"{rel}/: {len(dirs)} folders, {len(files)} files"
        more = len(lines) - LIST_MAX_ENTRIES
        body = "\n".join(lines[:LIST_MAX_ENTRIES])
        if more > 0:
            body += f"\n... and {more} more entries (use glob to narrow)"
        return ToolResult(ok=True, content=f"{head}\n{body}" if lines else f"{head} (empty)")


def glob_regex(pattern: str) -> re.Pattern:
    """A regex for a path glob: '*' and '?' stay within one folder, '**' spans folders,
    '[abc]' classes and '{a,b}' alternatives."""
    return re.compile(_glob_part(pattern) + r"\Z", re.DOTALL)


def _glob_part(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and (j := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1:j]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append(f"[{body.replace(chr(92), chr(92) * 2)}]")
            i = j + 1
        elif c == "{" and (j := pattern.find("}", i)) > 0:
            out.append("(?:" + "|".join(_glob_part(alt) for alt in pattern[i + 1:j].split(",")) + ")")
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def _git_listing(base: Path) -> list[str] | None:
    """Files under ``base`` that git would consider (tracked, or untracked and not ignored);
    None outside a git work tree."""
    try:
        proc = subprocess.run(["git", "-C", str(base), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                              capture_output=True, timeout=30, env=scrubbed_env(), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    listed = [os.fsdecode(p) for p in proc.stdout.split(b"\0") if p]
    if not listed and _ignored(base):
        return None                # a folder asked for by name is searched even if git ignores it (as rg does)
    return listed


def _ignored(path: Path) -> bool:
    try:
        proc = subprocess.run(["git", "-C", str(path.parent), "check-ignore", "-q", path.name],
                              capture_output=True, timeout=30, env=scrubbed_env(), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def project_files(base: Path, cancel: threading.Event | None = None) -> list[Path]:
    """Regular files under ``base`` (not symlinks, nothing in .git, nothing git ignores),
    sorted folder by folder like ``rg --sort path``."""
    listed = _git_listing(base)
    found: list[Path] = []
    if listed is not None:
        for rel in set(listed):
            if cancel is not None and cancel.is_set():
                break
            p = base / rel
            if ".git" in p.relative_to(base).parts or p.is_symlink() or not p.is_file():
                continue
            found.append(p)
    else:
        for top, dirnames, filenames in os.walk(base, followlinks=False):
            if cancel is not None and cancel.is_set():
                break
            dirnames[:] = [d for d in dirnames if d != ".git"]
            for name in filenames:
                p = Path(top, name)
                if not p.is_symlink() and p.is_file():
                    found.append(p)
    found.sort(key=lambda p: p.relative_to(base).parts)
    return found


class GlobTool(Tool):
    name = "glob"
    kind = "read"
    description = (
        "Find files by path pattern, recursively: '**/*.py', 'src/**/test_*.py', '*.{js,ts}' (a pattern without "
        "'/' matches file names in every folder). Skips .git and files git ignores. Newest first by default; "
        f"at most {GLOB_MAX_RESULTS} paths.")
    parameters = {
        "type": "object",
        "properties": {
            "pattern": {"type": "string", "description": "glob pattern relative to path"},
            "path": {"type": "string", "description": "folder to search (default '.')"},
            "sort": {"type": "string", "enum": ["mtime", "name"], "description": "newest first (default) or by name"},
        },
        "required": ["pattern"],
        "additionalProperties": False,
    }

    def assess(self, args: dict, ctx: ToolContext) -> Assessment:
        return path_assessment("read", args.get("path", "."), ctx, f"glob {args['pattern']}")

    def execute(self, args: dict, ctx: ToolContext) -> ToolResult:
        pattern = args["pattern"].strip()
        while pattern.startswith("./"):
            pattern = pattern[2:]
        if pattern.startswith("/") or ".." in pattern.split("/"):
            return _error("pattern must be relative and stay inside the project; put the folder in path")
        if not pattern:
            return _error("empty pattern")
        base = _resolve(ctx, args.get("path", "."))
        if isinstance(base, ToolResult):
            return base
        if not base.is_dir():
            return _error(f"{ctx.boundary.relative(base)} is not a folder")
        regex = glob_regex(pattern)
        by_name = "/" not in pattern
        matches = []
        for p in project_files(base, ctx.cancel):
            rel = p.relative_to(base).as_posix()
            if regex.match(p.name if by_name else rel):
                matches.append(p)
        stopped = ctx.cancel.is_set()
        if args.get("sort", "mtime") == "mtime":
            def mtime(p: Path) -> float:
                try:
                    return p.stat().st_mtime
                except OSError:
                    return 0.0
            matches.sort(key=lambda p: (-mtime(p), p.relative_to(base).parts))
        lines = [ctx.boundary.relative(p) for p in matches[:GLOB_MAX_RESULTS]]
        note = ""
        if len(matches) > GLOB_MAX_RESULTS:
            note = f"\n... and {len(matches) - GLOB_MAX_RESULTS} more (narrow the pattern or path)"
        if stopped:
            return ToolResult(ok=False, content="stopped by the user; partial results:\n" + "\n".join(lines) + note)
        if not matches:
            return ToolResult(ok=True, content=f"no files match {pattern!r} under {ctx.boundary.relative(base)}")
        return ToolResult(ok=True, content="\n".join(lines) + note)

