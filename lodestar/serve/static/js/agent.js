// The Agent view: a project picker, its sessions, the transcript with live tool cards,
// approvals, queued prompts and Stop (/api/projects, /api/agent/sessions/...).
import { api, events } from "./api.js";
import { byId, fmtAgo, h, hide, show, submitOnEnter } from "./dom.js";
import { AssistantMessage, UserMessage } from "./message.js";
import { ToolCard } from "./toolcard.js";

const enc = encodeURIComponent;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const PROJECT_KEY = "lodestar.agentProject";

function remembered() {
  try { return localStorage.getItem(PROJECT_KEY) || ""; } catch { return ""; }
}

function remember(project) {
  try { localStorage.setItem(PROJECT_KEY, project); } catch { /* this page only */ }
}

function turnSummary(stats) {
  if (!stats) return "The run ended.";      // after an error, which is shown above
  const s = stats;
  const parts = [s.stopped ? "Stopped" : "Turn done"];
  if (s.calls !== undefined) parts.push(`${s.calls} model call${s.calls === 1 ? "" : "s"}`);
  if (s.tools !== undefined) parts.push(`${s.tools} tool${s.tools === 1 ? "" : "s"} run`);
  if (s.output_tokens !== undefined) parts.push(`${s.output_tokens} tokens out`);
  if (s.prompt_tokens) parts.push(`${s.cached_tokens ?? 0} of ${s.prompt_tokens} prompt tokens cached`);
  if (s.first_ttft_s !== undefined && s.first_ttft_s !== null) {
    parts.push(`first token ${Math.round(s.first_ttft_s * 1000)} ms`);
  }
  if (s.seconds !== undefined) parts.push(`${Number(s.seconds).toFixed(1)} s`);
  if (s.compactions) parts.push(`${s.compactions} compaction${s.compactions === 1 ? "" : "s"}`);
  return parts.join(" · ");
}

class AgentView {
  constructor() {
    this.id = null;
    this.session = null;
    this.alive = true;
    this.busy = false;
    this.opening = 0;
    this.listener = null;          // AbortController of the live event stream
    this.live = false;             // events wait in `buffered` until the history is on screen
    this.buffered = [];
    this.cards = new Map();        // tool call id -> ToolCard
    this.asks = new Map();         // approval request id -> ToolCard
    this.current = null;           // the answer streaming in now
    this.sent = [];                // prompts this page sent, whose "prompt" events it has shown already

    this.log = byId("agent-log");
    this.prompt = byId("agent-prompt");
    this.notice = byId("agent-notice");
    byId("agent-composer").addEventListener("submit", (e) => { e.preventDefault(); this.submit(); });
    submitOnEnter(this.prompt, () => this.submit());
    byId("agent-stop").addEventListener("click", () => this.stop());
    byId("new-session").addEventListener("click", () => this.newSession());
    byId("project").addEventListener("change", () => {
      remember(byId("project").value);
      this.loadSessions();
      if (this.id) location.hash = "#/agent";
    });
    const toggle = byId("toggle-sessions");
    toggle.addEventListener("click", () => {
      const open = toggle.getAttribute("aria-expanded") !== "true";
      toggle.setAttribute("aria-expanded", String(open));
      byId("agent-sidebar").classList.toggle("open", open);
    });
  }

  async start(id) {
    await this.loadProjects();
    await this.open(id);
  }

  update({ id }) {
    if (id !== this.id) this.open(id);
  }

  unmount() {
    this.alive = false;
    this.detach();
  }

  // -- projects and sessions ------------------------------------------------------------
  async loadProjects() {
    const select = byId("project");
    let projects;
    try {
      projects = (await api("/api/projects")).data || [];
    } catch (e) {
      if (!this.alive) return;
      show(this.notice, e.message);
      this.setEnabled(false);
      return;
    }
    if (!this.alive) return;
    if (!projects.length) {
      show(this.notice, "The server lists no project folders: start it with --projects DIR.");
      this.setEnabled(false);
      return;
    }
    select.replaceChildren(...projects.map((p) => new Option(`${p.name} — ${p.path}`, p.path)));
    const wanted = remembered();
    if (projects.some((p) => p.path === wanted)) select.value = wanted;
    this.setEnabled(true);
    await this.loadSessions();
  }

  setEnabled(enabled) {
    this.enabled = enabled;
    for (const id of ["agent-prompt", "agent-send", "new-session", "project", "agent-mode"]) byId(id).disabled = !enabled;
  }

  async loadSessions() {
    const project = byId("project").value;
    if (!project) return;
    let sessions;
    try {
      sessions = (await api(`/api/agent/sessions?project=${enc(project)}`)).data || [];
    } catch (e) {
      if (this.alive) show(this.notice, `Could not list the sessions: ${e.message}`);
      return;
    }
    if (!this.alive) return;
    byId("session-empty").hidden = sessions.length > 0;
    byId("session-list").replaceChildren(...sessions.map((s) => this.sessionItem(s)));
  }

  sessionItem(s) {
    const title = s.title || "New session";
    const link = h("a", { class: "item-link", href: `#/agent/${enc(s.id)}`,
      "aria-current": s.id === this.id ? "page" : null },
      h("span", { class: "item-title" }, title),
      h("span", { class: "item-meta" }, `${s.mode} · ${fmtAgo(s.last_used)} · ${s.message_count ?? 0} messages`));
    link.addEventListener("click", () => {
      byId("agent-sidebar").classList.remove("open");
      byId("toggle-sessions").setAttribute("aria-expanded", "false");
    });
    const remove = h("button", { type: "button", class: "ghost small icon delete", "aria-label": `Delete session ${title}`,
      title: "Delete", onclick: async () => {
        try {
          await api(`/api/agent/sessions/${enc(s.id)}`, { method: "DELETE" });
        } catch (e) {
          show(this.notice, `Could not delete the session: ${e.message}`);
          return;
        }
        if (s.id === this.id) location.hash = "#/agent";
        this.loadSessions();
      } }, "✕");
    return h("li", { class: "item", dataset: { id: s.id } }, link, h("div", { class: "item-actions" }, remove));
  }

  async newSession() {
    const project = byId("project").value;
    if (!project) return null;
    try {
      const session = await api("/api/agent/sessions", { method: "POST",
        body: { project, mode: byId("agent-mode").value } });
      const opened = this.open(session.id);    // sets this.id at once: the hash change below is then a no-op
      location.hash = `#/agent/${enc(session.id)}`;
      await Promise.all([opened, this.loadSessions()]);
      return session;
    } catch (e) {
      show(this.notice, `Could not start a session: ${e.message}`);
      return null;
    }
  }

  // -- one session ------------------------------------------------------------------------
  clearLog() {
    this.cards.clear();
    this.asks.clear();
    this.current = null;
    for (const el of [...this.log.children]) if (el.id !== "agent-empty") el.remove();
    byId("agent-empty").hidden = false;
  }

  append(el) {
    byId("agent-empty").hidden = true;
    const follow = this.log.scrollHeight - this.log.scrollTop - this.log.clientHeight < 80;
    this.log.append(el);
    if (follow) this.log.scrollTop = this.log.scrollHeight;
    return el;
  }

  note(text, cls = "") {
    return this.append(h("p", { class: `note ${cls}`.trim() }, text));
  }

  setBusy(busy) {
    this.busy = busy;
    byId("agent-stop").disabled = !busy;
    byId("agent-state").textContent = busy ? "working…" : "idle";
    byId("agent-state").classList.toggle("busy", busy);
  }

  async open(id) {
    this.detach();
    const ticket = ++this.opening;
    this.id = id;
    this.clearLog();
    if (this.enabled) hide(this.notice);      // else it says why the agent cannot run here
    this.setBusy(false);
    for (const link of byId("session-list").querySelectorAll(".item-link")) {
      if (link.closest(".item").dataset.id === id) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    if (!id) {
      byId("agent-title").textContent = "Agent";
      return;
    }
    this.live = false;
    this.buffered = [];
    this.attach(id);                         // listen first, so nothing falls between history and events
    let detail;
    try {
      detail = await api(`/api/agent/sessions/${enc(id)}`);
    } catch (e) {
      if (ticket === this.opening && this.alive) show(this.notice, `Could not open the session: ${e.message}`);
      this.detach();
      return;
    }
    if (ticket !== this.opening || !this.alive) return;
    this.renderHistory(detail);
    this.live = true;
    for (const event of this.buffered.splice(0)) this.handle(event);
  }

  renderHistory(detail) {
    this.clearLog();
    const session = detail.session || {};
    this.session = session;
    byId("agent-title").textContent = session.title || "New session";
    if (session.project) {
      const select = byId("project");
      if ([...select.options].some((o) => o.value === session.project) && select.value !== session.project) {
        select.value = session.project;
        remember(session.project);
        this.loadSessions();
      }
    }
    if (session.mode) this.note(`Permission mode: ${session.mode}. Project: ${session.project}`, "meta");
    for (const m of detail.messages || []) this.renderStored(m);
    this.setBusy(!!detail.busy);
    if (detail.pending_approval) this.onApproval(detail.pending_approval);
    this.log.scrollTop = this.log.scrollHeight;
  }

  renderStored(m) {
    const meta = m.meta || {};
    if (m.role === "user") {
      this.append(new UserMessage(m.content || "").el);
    } else if (m.role === "assistant") {
      if (m.content || meta.reasoning) {
        const answer = AssistantMessage.stored({
          content: m.content, reasoning: meta.reasoning, stopped: meta.stopped,
          stats: { completion_tokens: m.tokens_out, prompt_tokens: m.tokens_in || null,
            cached_tokens: m.tokens_cached, ttft_ms: meta.ttft_ms, finish_reason: meta.finish_reason },
        });
        this.append(answer.el);
      }
      for (const call of m.tool_calls || []) {
        const card = new ToolCard(call.function?.name);
        card.start({ id: call.id, name: call.function?.name, arguments: call.function?.arguments });
        this.cards.set(call.id, card);
        this.append(card.el);
      }
    } else if (m.role === "tool") {
      let card = this.cards.get(m.tool_call_id);
      if (!card) {
        card = new ToolCard(m.name);
        this.append(card.el);
      }
      card.end({ ok: meta.ok !== false, content: m.content, display: meta.data?.diff });
      const approval = m.approval;
      if (approval && (approval.by === "user" || approval.action !== "allow")) {
        // the store words a user's answer itself ("denied by the user: REASON"): keep just the reason
        const why = (approval.reason || "").replace(/^(allowed once|denied) by the user:? ?/, "");
        card.decided(approval.action, why, approval.by === "user" ? "you" : "policy");
      }
    } else if (m.content) {
      this.note(meta.marker || m.role === "system" ? "Earlier steps were summarized to fit the context." : m.content,
        "meta");
    }
  }

  // -- live events -------------------------------------------------------------------------
  detach() {
    this.listener?.abort();
    this.listener = null;
  }

  async attach(id) {
    const controller = new AbortController();
    this.listener = controller;
    let first = true;
    while (this.alive && this.id === id && !controller.signal.aborted) {
      if (!first) {                      // the stream broke: what happened meanwhile is in the history
        this.live = false;
        this.buffered = [];
      }
      try {
        const stream = events(`/api/agent/sessions/${enc(id)}/events`, { signal: controller.signal });
        if (!first) this.reload(id);
        first = false;
        for await (const event of stream) {
          if (this.live) this.handle(event);
          else this.buffered.push(event);
        }
      } catch (e) {
        if (e.name === "AbortError") return;
        if ([401, 403, 404].includes(e.status)) {
          show(this.notice, `Live updates stopped: ${e.message}`);
          return;
        }
        first = false;
      }
      await sleep(1000);
    }
  }

  async reload(id) {
    try {
      const detail = await api(`/api/agent/sessions/${enc(id)}`);
      if (this.id !== id || !this.alive) return;
      this.renderHistory(detail);
      this.live = true;
      for (const event of this.buffered.splice(0)) this.handle(event);
    } catch { /* the next attempt tries again */ }
  }

  answer() {
    if (!this.current) {
      this.current = new AssistantMessage();
      this.append(this.current.el);
    }
    return this.current;
  }

  endAnswer() {
    if (!this.current) return;
    this.current.finish("", null);
    if (!this.current.content && !this.current.reasoning) this.current.el.remove();   // tool calls only
    this.current = null;
  }

  handle({ event, data }) {
    switch (event) {
      case "prompt":                   // from this page, or another one watching the same session
        if (this.sent.includes(data.text)) this.sent.splice(this.sent.indexOf(data.text), 1);
        else this.append(new UserMessage(data.text || "").el);
        if (data.queued) this.note("Queued: the agent reads it after its current step.", "meta");
        this.setBusy(true);
        break;
      case "delta":
        if (data.kind === "content" || data.kind === "reasoning") this.answer().add(data.kind, data.text || "");
        break;
      case "tool_start": {
        this.endAnswer();
        let card = this.cards.get(data.id);
        if (!card) {                     // an approval asked before the call started belongs to it
          card = [...this.asks.values()].find((c) => c.id === null && c.name === data.name);
        }
        if (!card) {
          card = new ToolCard(data.name);
          this.append(card.el);
        }
        card.start(data);
        if (data.decision === "deny" && card.el.dataset.state !== "denied") card.setState("denied");
        this.cards.set(data.id, card);
        break;
      }
      case "tool_end": {
        let card = this.cards.get(data.id);
        if (!card) {
          card = new ToolCard(data.name);
          this.append(card.el);
          this.cards.set(data.id, card);
        }
        card.end(data);
        break;
      }
      case "approval":
        this.endAnswer();
        this.onApproval(data);
        break;
      case "status":
        this.note(data.message || "", "meta");
        break;
      case "turn_end":
        this.endAnswer();
        this.note(turnSummary(data.stats), "turn-end");
        this.setBusy(false);
        this.loadSessions();
        break;
      case "error":
        this.endAnswer();
        this.append(h("div", { class: "error", role: "alert" }, data.message || String(data)));
        this.setBusy(false);
        break;
      default:
        break;
    }
  }

  onApproval(data) {
    if (this.asks.has(data.request_id)) return;
    // A reloaded page already shows the stored call this approval is about: ask on its card.
    let card = [...this.cards.values()].find((c) => c.requestId === null && c.el.dataset.state === "running"
      && c.name === data.tool && (data.arguments === undefined || c.rawArguments === data.arguments));
    if (!card) {
      card = new ToolCard(data.tool);
      this.append(card.el);
    }
    this.asks.set(data.request_id, card);
    const id = this.id;
    const approve = card.ask(data, async (allow, reason) => {
      try {
        await api(`/api/agent/sessions/${enc(id)}/approve`, { method: "POST",
          body: { request_id: data.request_id, allow, ...(reason ? { reason } : {}) } });
        return null;
      } catch (e) {
        return e.status === 404 ? "This request is no longer waiting (the run stopped?)." : e.message;
      }
    });
    this.setBusy(true);
    const typing = document.activeElement?.matches?.("input, textarea, select");
    if (!typing) approve.focus({ preventScroll: true });
  }

  // -- prompts and Stop ----------------------------------------------------------------------
  async submit() {
    const text = this.prompt.value;
    if (!text.trim()) return;
    this.prompt.value = "";
    hide(this.notice);
    if (!this.id) {
      if (!await this.newSession()) {
        this.prompt.value = text;
        return;
      }
    }
    const user = this.append(new UserMessage(text).el);
    this.sent.push(text);
    try {
      await api(`/api/agent/sessions/${enc(this.id)}/prompt`, { method: "POST", body: { text } });
      this.setBusy(true);
    } catch (e) {
      this.sent.splice(this.sent.indexOf(text), 1);
      user.classList.add("unsent");
      this.prompt.value = this.prompt.value || text;
      show(this.notice, `Not sent: ${e.message}`);
    }
  }

  async stop() {
    if (!this.id) return;
    try {
      await api(`/api/agent/sessions/${enc(this.id)}/stop`, { method: "POST" });
    } catch (e) {
      show(this.notice, `Could not stop: ${e.message}`);
    }
  }
}

export function mount(root, params) {
  const view = new AgentView();
  view.start(params.id);
  return view;
}
