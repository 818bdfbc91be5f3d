// One agent tool call on screen: its state, what it does, its risks, the approval it waits
// for, its diff and its output.
import { h } from "./dom.js";

const STATE_LABELS = {
  waiting: "waiting for approval", running: "running", ok: "done", failed: "failed", denied: "denied",
};

/** A unified diff with each line marked as added, removed or a hunk header. */
export function diffView(text) {
  const pre = h("pre", { class: "diff", "aria-label": "Changes" });
  for (const line of text.replace(/\n$/, "").split("\n")) {
    let cls = "ctx";
    if (line.startsWith("+++") || line.startsWith("---")) cls = "file";
    else if (line.startsWith("@@")) cls = "hunk";
    else if (line.startsWith("+")) cls = "add";
    else if (line.startsWith("-")) cls = "del";
    pre.append(h("span", { class: `diff-line ${cls}` }, line + "\n"));
  }
  return pre;
}

/** The arguments as an object (they arrive as JSON text), or null. */
function parsed(args) {
  if (args && typeof args === "object") return args;
  try { return JSON.parse(args); } catch { return null; }
}

/** A one-line summary for a call the server described no further (a stored one). */
function summaryOf(args) {
  const a = parsed(args);
  if (!a || typeof a !== "object") return "";
  const main = a.command ?? a.path ?? a.pattern ?? a.query ?? a.job ?? "";
  return typeof main === "string" ? main : JSON.stringify(main);
}

function prettyArguments(args) {
  if (typeof args !== "string") return JSON.stringify(args, null, 2);
  try { return JSON.stringify(JSON.parse(args), null, 2); } catch { return args; }
}

export class ToolCard {
  constructor(name) {
    this.id = null;
    this.requestId = null;
    this.rawArguments = undefined;
    this.name = name || "tool";
    this.nameEl = h("span", { class: "tool-name" }, this.name);
    this.summary = h("span", { class: "tool-summary" });
    this.state = h("span", { class: "tool-state badge" });
    this.risks = h("p", { class: "risks", hidden: true });
    this.approval = h("div", { class: "approval", hidden: true });
    this.diff = h("div", { class: "diff-wrap", hidden: true });
    this.outputPre = h("pre", { class: "tool-output" });
    this.output = h("details", { class: "tool-details", hidden: true }, h("summary", {}, "Output"), this.outputPre);
    this.argsPre = h("pre", { class: "tool-args" });
    this.args = h("details", { class: "tool-details", hidden: true }, h("summary", {}, "Arguments"), this.argsPre);
    this.el = h("article", { class: "tool-card", "aria-label": `Tool call ${this.name}` },
      h("header", { class: "tool-head" }, this.nameEl, this.summary, this.state),
      this.risks, this.approval, this.diff, this.args, this.output);
    this.setState("running");
  }

  setState(state) {
    this.el.dataset.state = state;
    this.state.textContent = STATE_LABELS[state] || state;
  }

  setName(name) {
    if (!name) return;
    this.name = name;
    this.nameEl.textContent = name;
    this.el.setAttribute("aria-label", `Tool call ${name}`);
  }

  describe({ summary, risks, arguments: args }) {
    if (summary) this.summary.textContent = summary;
    else if (!this.summary.textContent) this.summary.textContent = summaryOf(args);
    if (risks && risks.length) {
      this.risks.textContent = `Risks: ${[...risks].join(", ")}`;
      this.risks.hidden = false;
    }
    if (args !== undefined && args !== null && args !== "") {
      this.rawArguments = args;
      this.argsPre.textContent = prettyArguments(args);
      this.args.hidden = false;
    }
  }

  /** tool_start: the call runs now (or was refused; its tool_end says so). */
  start(event) {
    this.id = event.id ?? this.id;
    this.setName(event.name);
    this.describe(event);
    if (this.el.dataset.state !== "denied") this.setState("running");
  }

  /** tool_end, or a stored tool result. */
  end({ ok, content, display }) {
    if (this.el.dataset.state !== "denied") this.setState(ok ? "ok" : "failed");
    if (display) {
      this.diff.replaceChildren(diffView(display));
      this.diff.hidden = false;
    }
    if (content) {
      this.outputPre.textContent = content;
      this.output.hidden = false;
      if (!ok && !display) this.output.open = true;    // a failure's reason is worth seeing at once
    }
  }

  /** An approval request: Approve / Deny with an optional reason; `decide(allow, reason)` sends it. */
  ask(event, decide) {
    this.requestId = event.request_id;
    this.setName(event.tool);
    this.describe(event);
    this.setState("waiting");
    const reason = h("input", { type: "text", class: "deny-reason", "aria-label": "Reason (optional, told to the model)",
      placeholder: "Reason (optional)" });
    const approve = h("button", { type: "button", class: "approve" }, "Approve");
    const deny = h("button", { type: "button", class: "danger deny" }, "Deny");
    const status = h("p", { class: "hint", role: "status" });
    const send = async (allow) => {
      approve.disabled = deny.disabled = reason.disabled = true;
      status.textContent = "Sending…";
      const error = await decide(allow, reason.value.trim());
      if (error) {
        status.textContent = error;
        approve.disabled = deny.disabled = reason.disabled = false;
        return;
      }
      this.decided(allow ? "allow" : "deny", reason.value.trim(), "you");
    };
    approve.addEventListener("click", () => send(true));
    deny.addEventListener("click", () => send(false));
    const why = event.reason ? h("p", { class: "approval-reason" }, event.reason) : null;
    this.approval.replaceChildren(why || "", h("div", { class: "row-actions" }, approve, deny, reason), status);
    this.approval.hidden = false;
    return approve;
  }

  /** Shows who allowed or denied the call. */
  decided(action, reason, by) {
    const verb = action === "allow" ? "Approved" : "Denied";
    const who = by === "policy" ? "by the permission mode" : `by ${by}`;
    this.approval.replaceChildren(h("p", { class: `decision ${action}` },
      `${verb} ${who}${reason ? ": " + reason : ""}`));
    this.approval.hidden = false;
    if (action !== "allow") this.setState("denied");
    else if (this.el.dataset.state === "waiting") this.setState("running");
  }
}
