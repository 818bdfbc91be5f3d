"""todo: the agent's plan for the current task, a short checklist it rewrites as it works."""
from __future__ import annotations

from lodestar.agent.tools import Tool, ToolContext, ToolResult

TODO_MAX_ITEMS = 50
TODO_STATUSES = ("pending", "in_progress", "done")
_MARK = {"pending": "[ ]", "in_progress": "[>]", "done": "[x]"}


def render_todo(items: list[dict]) -> str:
    """One line per item: '[x] done', '[>] in progress', '[ ] pending'."""
    return "\n".join(f"{_MARK[i['status']]} {i['text']}" for i in items)


class TodoTool(Tool):
    name = "todo"
    kind = "meta"
    description = ("Replace your plan for the current task with this list of steps, each pending, in_progress or "
                   "done. Keep one step in_progress; update the list as steps finish.")
    parameters = {
        "type": "object",
        "properties": {
            "items": {
                "type": "array", "maxItems": TODO_MAX_ITEMS,
                "items": {
                    "type": "object",
                    "properties": {"text": {"type": "string", "minLength": 1},
                                   "status": {"type": "string", "enum": list(TODO_STATUSES)}},
                    "required": ["text", "status"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["items"],
        "additionalProperties": False,
    }

    def execute(self, args: dict, ctx: ToolContext) -> ToolResult:
        items = [{"text": " ".join(i["text"].split())[:300], "status": i["status"]} for i in args["items"]]
        ctx.todo[:] = items              # in place: the UI holds the same list
        if not items:
            return ToolResult(ok=True, content="plan cleared", data={"todo": []})
        done = sum(i["status"] == "done" for i in items)
        return ToolResult(ok=True, content=f"plan ({done}/{len(items)} done):\n{render_todo(items)}",
                          data={"todo": [dict(i) for i in items]})
