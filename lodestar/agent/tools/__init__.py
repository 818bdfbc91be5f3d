"""The agent's tools: what the model may call, their JSON schemas, and the checks every call
passes before it runs.

A call goes ``validate_call`` (JSON and schema) -> ``Tool.assess`` (what it touches, how
risky; policy.decide turns that into allow/ask/deny) -> ``Tool.run``. Every result the model
sees is bounded; long output is spilled to a file in ``ToolContext.spill_dir`` that the
``read`` tool can open.

Arguments are validated with ``jsonschema`` (Draft 2020-12): the reference implementation of
JSON Schema, whose messages name the failing field precisely enough for a model to fix its call.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import jsonschema

from lodestar.agent.policy import (
    Assessment,
    BoundaryError,
    ProjectBoundary,
    scrubbed_env,
)

if TYPE_CHECKING:
    from lodestar.agent.tools.shell import JobTable


@dataclass
class ToolResult:
    ok: bool                       # False: the call failed; content says why (the model sees it)
    content: str                   # what the model sees, always bounded
    display: str | None = None     # richer text for a UI (a unified diff for write/edit)
    data: dict | None = None       # structured payload ({"path":..., "diff":...}, {"job": id})


@dataclass
class ToolContext:
    boundary: ProjectBoundary
    spill_dir: Path                # overflow files; readable by `read`
    jobs: "JobTable"               # background shell jobs
    todo: list[dict]               # the agent's plan, replaced by the todo tool
    cancel: threading.Event        # Stop: long work must end promptly and say so
    env: dict[str, str]            # scrubbed environment for commands
    shell_timeout: float = 120.0


class Tool:
    """One tool the model can call. Subclasses set name, description, parameters and kind and
    implement execute; assess defaults to "this kind, no risk"."""
    name: str = ""
    description: str = ""
    parameters: dict = {}
    kind: str = "read"

    def check(self, args: dict) -> str | None:
        """Cross-field rules the schema cannot say simply; a message when the call is malformed."""
        return None

    def assess(self, args: dict, ctx: ToolContext) -> Assessment:
        return Assessment(kind=self.kind, summary=f"{self.name} {_brief(args)}")

    def run(self, args: dict, ctx: ToolContext) -> ToolResult:
        """Run a validated call. File-system failures (permissions, a file removed meanwhile)
        become a failed result the model can act on, never an exception in the loop."""
        try:
            return self.execute(args, ctx)
        except OSError as e:
            where = f" ({e.filename})" if e.filename else ""
            return ToolResult(ok=False, content=f"error: {self.name} failed: {e.strerror or e}{where}")

    def execute(self, args: dict, ctx: ToolContext) -> ToolResult:
        raise NotImplementedError

    def schema(self) -> dict:
        """The OpenAI chat ``tools`` entry."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def _brief(args: dict) -> str:
    text = " ".join(f"{k}={v!r}" for k, v in args.items())
    return text if len(text) <= 120 else text[:117] + "..."


def path_assessment(kind: str, path: str, ctx: ToolContext, summary: str, *, write: bool = False) -> Assessment:
    """An assessment for a tool that touches one path: refused when the path is outside."""
    try:
        real = ctx.boundary.resolve(path, write=write)
    except BoundaryError as e:
        return Assessment(kind=kind, summary=summary, refused=str(e))
    return Assessment(kind=kind, summary=summary, target=ctx.boundary.relative(real))


# -- bounded output ---------------------------------------------------------------------------
def clip(text: str, limit: int, head: int | None = None) -> tuple[str, bool]:
    """Keep the first ``head`` and the last ``limit - head`` characters; (text, was_cut)."""
    if len(text) <= limit:
        return text, False
    head = limit * 3 // 8 if head is None else head
    tail = limit - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n... [{cut} characters cut] ...\n{text[-tail:]}", True


# -- the registry ------------------------------------------------------------------------------
def tool_schemas(names: Iterable[str] | None = None) -> list[dict]:
    """OpenAI chat ``tools`` entries for the named tools (all when None)."""
    chosen = list(TOOLS) if names is None else list(names)
    unknown = [n for n in chosen if n not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; available: {', '.join(TOOLS)}")
    return [TOOLS[n].schema() for n in chosen]


def signature(tool: Tool) -> str:
    """A compact form of a tool's schema for error messages: read(path: string, offset?: integer)."""
    props = tool.parameters.get("properties", {})
    required = set(tool.parameters.get("required", []))
    parts = []
    for key, spec in props.items():
        kind = spec.get("type", "any")
        if kind == "array" and isinstance(spec.get("items"), dict):
            item = spec["items"]
            inner = item.get("properties")
            kind = (f"[{{{', '.join(inner)}}}]" if inner else f"{item.get('type', 'any')}[]")
        if "enum" in spec:
            kind = "|".join(map(str, spec["enum"]))
        parts.append(f"{key}{'' if key in required else '?'}: {kind}")
    return f"{tool.name}({', '.join(parts)})"


def validate_call(name: str, arguments: str | dict) -> tuple[Tool, dict] | ToolResult:
    """The tool and its parsed arguments, or a failed ToolResult saying what is wrong (the tool
    is not run)."""
    tool = TOOLS.get(name)
    if tool is None:
        return ToolResult(ok=False, content=f"error: unknown tool {name!r}; available tools: {', '.join(TOOLS)}")
    expected = f"expected: {signature(tool)}"
    if isinstance(arguments, str):
        if not arguments.strip():
            arguments = "{}"              # models send "" for calls without arguments
        try:
            args = json.loads(arguments)
        except json.JSONDecodeError as e:
            return ToolResult(ok=False, content=f"error: arguments of {name} are not valid JSON ({e}); {expected}")
    else:
        args = arguments
    if not isinstance(args, dict):
        return ToolResult(ok=False, content=f"error: arguments of {name} must be a JSON object; {expected}")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(tool.parameters).iter_errors(args))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        at = f" at {where!r}" if where else ""
        return ToolResult(ok=False, content=f"error: invalid arguments for {name}{at}: {error.message}; {expected}")
    problem = tool.check(args)
    if problem:
        return ToolResult(ok=False, content=f"error: invalid arguments for {name}: {problem}; {expected}")
    return tool, args


def new_context(root: str | Path, spill_dir: str | Path, cancel: threading.Event | None = None) -> ToolContext:
    """A context for one agent session in the project ``root``; spill files go to ``spill_dir``."""
    spill_path = Path(spill_dir)
    spill_path.mkdir(parents=True, exist_ok=True)
    return ToolContext(boundary=ProjectBoundary(root, extra_read_roots=[spill_path]), spill_dir=spill_path,
                       jobs=JobTable(), todo=[], cancel=cancel or threading.Event(), env=scrubbed_env())


# The tool modules import the types above, so they are imported after them.
from lodestar.agent.tools.files import EditTool, GlobTool, ListTool, ReadTool, WriteTool  # noqa: E402
from lodestar.agent.tools.git import GitTool  # noqa: E402
from lodestar.agent.tools.search import GrepTool  # noqa: E402
from lodestar.agent.tools.shell import JobKillTool, JobOutputTool, JobTable, ShellTool  # noqa: E402
from lodestar.agent.tools.todo import TodoTool  # noqa: E402

TOOLS: dict[str, Tool] = {t.name: t for t in (
    ReadTool(), WriteTool(), EditTool(), ListTool(), GlobTool(), GrepTool(), GitTool(),
    ShellTool(), JobOutputTool(), JobKillTool(), TodoTool())}
