"""git: read-only git commands in the project (status, diff, log, show, blame, branch listing,
rev-parse, ls-files). Anything that changes the repository goes through shell, where the
policy sees it.
"""
from __future__ import annotations

from pathlib import Path

from lodestar.agent.policy import Assessment, ProjectBoundary, outside_path
from lodestar.agent.tools import Tool, ToolContext, ToolResult
from lodestar.agent.tools.shell import run_captured

GIT_ALLOWED = ("status", "diff", "log", "show", "blame", "branch", "rev-parse", "ls-files")
GIT_MAX_CHARS = 24_000
GIT_TIMEOUT_S = 30.0
# options of the allowed commands that write files, run programs or read files outside the repo
_BLOCKED = ("--output", "--no-index", "--ext-diff", "--contents", "--open-files-in-pager", "--exec")
# git branch stays a listing: these options are allowed; the ones taking a value may be followed by it
_BRANCH_FLAGS = frozenset({"-a", "--all", "-r", "--remotes", "-v", "-vv", "--verbose", "--list", "-l",
                           "--show-current", "--no-color", "--no-column", "-i", "--ignore-case", "--omit-empty"})
_BRANCH_WITH_VALUE = frozenset({"--contains", "--no-contains", "--merged", "--no-merged", "--points-at"})


def check_git_args(args: list[str]) -> str | None:
    """Why the git call is not allowed, or None."""
    if not args:
        return f"give a subcommand: one of {', '.join(GIT_ALLOWED)}"
    sub, rest = args[0], args[1:]
    if sub not in GIT_ALLOWED:
        return (f"git {sub} is not allowed here: only the read-only {', '.join(GIT_ALLOWED)}; "
                "run other git commands with shell")
    for a in rest:
        name = a.split("=", 1)[0]
        # git takes any unambiguous prefix of a long option: --cont=X is --contents=X
        if a.startswith(_BLOCKED) or (len(name) > 2 and name.startswith("--")
                                      and any(b.startswith(name) for b in _BLOCKED)):
            return f"option {a} is not allowed with the git tool"
    if sub == "branch":
        listing = "--list" in rest or "-l" in rest
        takes_value = False
        for a in rest:
            if takes_value:
                takes_value = False
            elif a in _BRANCH_WITH_VALUE:
                takes_value = True
            elif a.startswith(("--sort=", "--format=", "--color=", "--column=", "--contains=", "--merged=",
                               "--no-merged=", "--points-at=", "--abbrev=")):
                pass
            elif a in _BRANCH_FLAGS:
                pass
            elif a.startswith("-") or not listing:
                return ("git branch may only list branches (use --list PATTERN to filter); "
                        "create or delete them with shell")
    return None


def check_git_reach(args: list[str], boundary: ProjectBoundary) -> str | None:
    """Why the call would read outside the project, or None: a path argument outside it (``git
    diff A B`` with a path outside the work tree is ``--no-index`` and prints both files), or a
    repository that starts above the project (``git show HEAD:x`` reads its other folders)."""
    for a in args[1:]:
        values = [a, a[2:]] if a.startswith("-") and not a.startswith("--") else [a]   # -O/etc/x
        if any(outside_path(v, boundary) for v in values if v):
            return f"argument {a!r} names a path outside the project (or one the project boundary refuses)"
    top = _repository_above(boundary.root)
    if top is not None:
        return (f"the git repository at {top} reaches beyond the project ({boundary.root}), so git would read "
                "files outside it; run git through shell instead, where it is classified and asked")
    return None


def _repository_above(root: Path) -> Path | None:
    """The folder above ``root`` holding the repository git would find from it, or None when
    the project is its own repository (or in none)."""
    if (root / ".git").exists():
        return None
    return next((p for p in root.parents if (p / ".git").exists()), None)


class GitTool(Tool):
    name = "git"
    kind = "read"
    description = (f"Run a read-only git command in the project: {', '.join(GIT_ALLOWED)} (branch only lists). "
                   "args is the argument list after 'git', e.g. [\"diff\", \"--stat\"] or "
                   "[\"log\", \"-5\", \"--oneline\"]. "
                   "Long output is cut and saved to a file you can read.")
    parameters = {
        "type": "object",
        "properties": {
            "args": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                     "description": "arguments after 'git'; the first is the subcommand"},
        },
        "required": ["args"],
        "additionalProperties": False,
    }

    def check(self, args: dict) -> str | None:
        return check_git_args(args["args"])

    def assess(self, args: dict, ctx: ToolContext) -> Assessment:
        summary = "git " + " ".join(args["args"])
        refused = check_git_args(args["args"]) or check_git_reach(args["args"], ctx.boundary)
        return Assessment(kind="read", summary=summary[:200], refused=refused)

    def execute(self, args: dict, ctx: ToolContext) -> ToolResult:
        problem = check_git_args(args["args"]) or check_git_reach(args["args"], ctx.boundary)
        if problem:
            return ToolResult(ok=False, content=f"error: {problem}")
        root = str(ctx.boundary.root)
        argv = ["git", "-C", root, "--no-pager", "-c", "core.pager=cat", "-c", "core.fsmonitor=false",
                "-c", "color.ui=false", *args["args"]]
        try:
            done, text = run_captured(argv, ctx, timeout=GIT_TIMEOUT_S, prefix="git", limit=GIT_MAX_CHARS)
        except OSError as e:
            return ToolResult(ok=False, content=f"error: cannot run git: {e}")
        text = text if text.strip() else "(no output)"
        if done.status != "exited":
            return ToolResult(ok=False, content=f"git {done.status_text()}\n{text}")
        if done.returncode != 0:
            return ToolResult(ok=False, content=f"git exited with code {done.returncode}\n{text}")
        return ToolResult(ok=True, content=text)
