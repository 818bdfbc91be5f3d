// The Chat view: conversations stored by the server (/api/conversations), streamed answers
// rendered as markdown, Stop, regenerate, edit-and-resend and per-conversation settings.
import { api, ApiError, events } from "./api.js";
import { byId, debounce, fmtAgo, h, hide, show, submitOnEnter } from "./dom.js";
import { copyButton } from "./markdown.js";
import { AssistantMessage, describeStats, UserMessage } from "./message.js";

const enc = encodeURIComponent;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function titleFrom(text) {
  const flat = text.trim().replace(/\s+/g, " ");
  return flat.length > 60 ? flat.slice(0, 59) + "…" : flat;
}

// -- the view ------------------------------------------------------------------------------
class ChatView {
  constructor() {
    this.id = null;
    this.title = "";
    this.settings = {};
    this.items = [];              // messages the server has (or is about to have), in order
    this.controller = null;       // the answer being streamed
    this.busy = false;
    this.alive = true;
    this.opening = 0;             // ignores a slow load of a conversation left since

    this.log = byId("log");
    this.prompt = byId("prompt");
    this.notice = byId("notice");
    byId("composer").addEventListener("submit", (e) => { e.preventDefault(); this.submit(); });
    submitOnEnter(this.prompt, () => this.submit());
    byId("stop").addEventListener("click", () => this.stop());
    byId("new-chat").addEventListener("click", () => {
      if (location.hash === "#/chat") this.open(null);
      else location.hash = "#/chat";
    });
    byId("conv-search").addEventListener("input", debounce(() => this.loadList(), 200));
    this.onKey = (e) => { if (e.key === "Escape" && this.controller) this.stop(); };
    document.addEventListener("keydown", this.onKey);
    this.wireToggle("toggle-conversations", "conv-sidebar");
    this.wireToggle("toggle-settings", "chat-settings", true);
    this.wireSettings();
  }

  wireToggle(buttonId, targetId, useHidden = false) {
    const button = byId(buttonId);
    const target = byId(targetId);
    button.addEventListener("click", () => {
      const open = button.getAttribute("aria-expanded") !== "true";
      button.setAttribute("aria-expanded", String(open));
      if (useHidden) target.hidden = !open;
      else target.classList.toggle("open", open);
    });
  }

  update({ id }) {
    if (id !== this.id) this.open(id);
  }

  unmount() {
    this.alive = false;
    this.stop();
    document.removeEventListener("keydown", this.onKey);
  }

  // -- the conversation list ----------------------------------------------------------------
  async loadList() {
    const q = byId("conv-search").value.trim();
    let data;
    try {
      data = (await api(`/api/conversations?limit=100${q ? "&q=" + enc(q) : ""}`)).data || [];
    } catch (e) {
      if (this.alive) show(this.notice, `Could not list the conversations: ${e.message}`);
      return;
    }
    if (!this.alive) return;
    byId("conv-empty").hidden = data.length > 0;
    byId("conv-empty").textContent = q ? "Nothing matches." : "No conversations yet.";
    byId("conv-list").replaceChildren(...data.map((c) => this.listItem(c)));
  }

  listItem(conv) {
    const title = conv.title || "Untitled";
    const link = h("a", { class: "item-link", href: `#/chat/${enc(conv.id)}`,
      "aria-current": conv.id === this.id ? "page" : null },
      h("span", { class: "item-title" }, title),
      h("span", { class: "item-meta" }, `${fmtAgo(conv.last_used)} · ${conv.message_count ?? 0} messages`));
    link.addEventListener("click", () => this.closeNarrowSidebar());
    const li = h("li", { class: "item", dataset: { id: conv.id } }, link);
    const actions = h("div", { class: "item-actions" },
      h("button", { type: "button", class: "ghost small icon rename", "aria-label": `Rename ${title}`,
        title: "Rename", onclick: () => this.startRename(li, conv) }, "✎"),
      h("button", { type: "button", class: "ghost small icon delete", "aria-label": `Delete ${title}`,
        title: "Delete", onclick: () => this.confirmDelete(li, conv, actions) }, "✕"));
    li.append(actions);
    return li;
  }

  closeNarrowSidebar() {
    byId("conv-sidebar").classList.remove("open");
    byId("toggle-conversations").setAttribute("aria-expanded", "false");
  }

  markCurrent() {
    for (const link of byId("conv-list").querySelectorAll(".item-link")) {
      const current = link.closest(".item").dataset.id === this.id;
      if (current) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
  }

  startRename(li, conv) {
    const input = h("input", { type: "text", class: "rename-input", value: conv.title || "",
      "aria-label": `New title for ${conv.title || "this conversation"}` });
    let done = false;
    const finish = async (save) => {
      if (done) return;
      done = true;
      const title = input.value.trim();
      if (save && title && title !== conv.title) {
        try {
          await api(`/api/conversations/${enc(conv.id)}`, { method: "PATCH", body: { title } });
          if (conv.id === this.id) this.setTitle(title);
        } catch (e) {
          show(this.notice, `Could not rename the conversation: ${e.message}`);
        }
      }
      await this.loadList();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") { e.preventDefault(); finish(true); }
      else if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); finish(false); }
    });
    input.addEventListener("blur", () => finish(true));
    li.replaceChildren(input);
    input.focus();
    input.select();
  }

  confirmDelete(li, conv, actions) {
    const title = conv.title || "Untitled";
    const cancel = h("button", { type: "button", class: "ghost small", onclick: () => this.loadList() }, "Cancel");
    const confirm = h("button", { type: "button", class: "danger small confirm-delete",
      "aria-label": `Delete ${title} for good`, onclick: async () => {
        try {
          await api(`/api/conversations/${enc(conv.id)}`, { method: "DELETE" });
        } catch (e) {
          show(this.notice, `Could not delete the conversation: ${e.message}`);
        }
        if (conv.id === this.id) location.hash = "#/chat";
        await this.loadList();
      } }, "Delete");
    li.classList.add("confirming");
    actions.replaceChildren(h("span", { class: "hint" }, "Delete?"), confirm, cancel);
    confirm.focus();
  }

  // -- one conversation ----------------------------------------------------------------------
  setTitle(title) {
    this.title = title;
    byId("chat-title").textContent = title || "New chat";
  }

  clearLog() {
    this.items = [];
    for (const el of [...this.log.querySelectorAll(".msg")]) el.remove();
    byId("empty").hidden = false;
  }

  async open(id) {
    this.stop();
    const ticket = ++this.opening;
    this.id = id;
    this.clearLog();
    hide(this.notice);
    this.markCurrent();
    if (!id) {
      this.setTitle("");
      this.fillSettings({});
      this.loadList();
      this.prompt.focus();
      return;
    }
    let conv;
    try {
      conv = await api(`/api/conversations/${enc(id)}`);
    } catch (e) {
      if (ticket !== this.opening || !this.alive) return;
      const why = e.status === 404 ? "This conversation does not exist (deleted?). Start a new chat." : e.message;
      show(this.notice, `Could not open the conversation: ${why}`);
      this.loadList();
      return;
    }
    if (ticket !== this.opening || !this.alive) return;
    this.setTitle(conv.title);
    this.fillSettings(conv.settings || {});
    this.renderMessages(conv.messages || []);
    this.loadList();
    this.prompt.focus();
  }

  renderMessages(messages) {
    this.clearLog();
    for (const m of messages) {
      if (m.role === "user") {
        const item = new UserMessage(m.content || "");
        item.seq = m.seq;
        this.append(item);
      } else if (m.role === "assistant") {
        this.append(AssistantMessage.stored(m));
      }
    }
    this.refreshActions();
    this.scrollDown(true);
  }

  append(item) {
    byId("empty").hidden = true;
    this.items.push(item);
    this.log.append(item.el);
    return item;
  }

  nearBottom() {
    return this.log.scrollHeight - this.log.scrollTop - this.log.clientHeight < 80;
  }

  scrollDown(force = false) {
    if (force || this.nearBottom()) this.log.scrollTop = this.log.scrollHeight;
  }

  /** Edit on stored user messages; Regenerate on the last answer; Copy on every answer. */
  refreshActions() {
    const last = this.items.at(-1);
    for (const item of this.items) {
      const buttons = [];
      if (item.role === "user" && item.seq !== null && !this.busy) {
        buttons.push(h("button", { type: "button", class: "ghost small edit", onclick: () => this.startEdit(item) },
          "Edit"));
        if (item === last) {             // no answer was stored (an error): ask again
          buttons.push(h("button", { type: "button", class: "ghost small retry", onclick: () => this.regenerate() },
            "Retry"));
        }
      }
      if (item.role === "assistant") {
        buttons.push(copyButton(() => item.content, "Copy"));
        if (item === last && !this.busy) {
          buttons.push(h("button", { type: "button", class: "ghost small regenerate",
            onclick: () => this.regenerate() }, "Regenerate"));
        }
      }
      item.actions.replaceChildren(...buttons);
    }
  }

  // -- sending --------------------------------------------------------------------------------
  async submit() {
    const text = this.prompt.value;
    if (!text.trim() || this.busy) return;
    this.busy = true;
    this.prompt.value = "";
    hide(this.notice);
    try {
      if (!await this.flushSettings()) {
        this.prompt.value = text;
        return;
      }
      if (!this.id) {
        const conv = await api("/api/conversations", { method: "POST",
          body: { title: titleFrom(text), settings: this.settings } });
        this.id = conv.id;
        this.setTitle(conv.title || titleFrom(text));
        location.hash = `#/chat/${enc(conv.id)}`;    // the router sees the same id and keeps this view
      }
    } catch (e) {
      this.prompt.value = this.prompt.value || text;
      show(this.notice, `Could not start the conversation: ${e.message}`);
      return;
    } finally {
      this.busy = false;
    }
    await this.stream({ content: text }, text);
  }

  async regenerate() {
    if (this.busy) return;
    if (this.items.at(-1)?.role === "assistant") this.items.pop().el.remove();
    this.dropUnstored();
    await this.stream({ regenerate: true }, null);
  }

  startEdit(item) {
    if (this.busy) return;
    const area = h("textarea", { class: "edit-input", rows: 3, "aria-label": "Edit your message" });
    area.value = item.content;
    const cancel = () => { item.body.replaceChildren(item.content); item.el.classList.remove("editing");
      this.refreshActions(); };
    const save = () => { if (area.value.trim()) this.resend(item, area.value); };
    area.addEventListener("keydown", (e) => {
      if (e.key === "Escape") { e.preventDefault(); cancel(); }
      else if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); save(); }
    });
    item.el.classList.add("editing");
    item.body.replaceChildren(area, h("div", { class: "row-actions" },
      h("button", { type: "button", class: "small save-edit", onclick: save }, "Send"),
      h("button", { type: "button", class: "secondary small", onclick: cancel }, "Cancel")));
    item.actions.replaceChildren();
    area.focus();
  }

  async resend(item, text) {
    const at = this.items.indexOf(item);
    if (at < 0 || this.busy) return;
    for (const later of this.items.splice(at)) later.el.remove();
    this.dropUnstored();
    await this.stream({ edit_seq: item.seq, content: text }, text);
  }

  /** Removes failed requests' leftovers (shown, never stored) before the conversation changes. */
  dropUnstored() {
    for (const el of [...this.log.querySelectorAll(".msg.unstored")]) el.remove();
  }

  setStreaming(controller) {
    this.controller = controller;
    this.busy = !!controller;
    byId("stop").disabled = !controller;
    byId("send").disabled = !!controller;
    this.refreshActions();
  }

  async stream(body, userText) {
    const id = this.id;
    const user = userText === null ? null : this.append(new UserMessage(userText));
    const reply = this.append(new AssistantMessage());
    this.scrollDown(true);
    const controller = new AbortController();
    this.setStreaming(controller);
    const start = performance.now();
    let first = null, stored = null, error = null, stopped = false, refused = false;
    try {
      for await (const { event, data } of events(`/api/conversations/${enc(id)}/messages`,
        { method: "POST", body, signal: controller.signal })) {
        if (event === "delta") {
          if (first === null) first = performance.now();
          reply.add(data.kind, data.text || "");
          if (this.nearBottom()) requestAnimationFrame(() => this.scrollDown(true));
        } else if (event === "done") {
          stored = data.message;
        } else if (event === "error") {
          error = data?.message || String(data);
        }
      }
    } catch (e) {
      if (e.name === "AbortError") stopped = true;
      else if (e instanceof ApiError) { error = e.message; refused = true; }
      else error = `The stream broke off: ${e.message}`;
    } finally {
      if (this.controller === controller) this.setStreaming(null);
    }
    if (!this.alive || this.id !== id) return;
    if (stored) {
      reply.seq = stored.seq;
      reply.content = stored.content ?? reply.content;
      reply.reasoning = stored.reasoning ?? reply.reasoning;
      reply.finish(describeStats(stored.stats, stored.stopped), null);
    } else {
      const ttft = first === null ? null : first - start;
      reply.finish(stopped ? describeStats({ ttft_ms: ttft }, true) : "", error);
    }
    if (refused) {
      // Refused before anything was stored: the text goes back to the composer for another try.
      this.items.splice(this.items.indexOf(reply), 1);
      reply.el.classList.add("unstored");
      if (user) {
        this.items.splice(this.items.indexOf(user), 1);
        user.el.classList.add("unstored", "unsent");
        if (!this.prompt.value) this.prompt.value = userText;
      }
      this.refreshActions();
    } else {
      await this.reconcile(id, !error);
    }
    if (this.alive && this.id === id) {
      this.loadList();
      if (document.activeElement === document.body || document.activeElement === byId("stop")) this.prompt.focus();
    }
  }

  /**
   * Takes sequence numbers (and a stopped answer's stored stats) from the server. A stopped
   * answer is stored once the server notices the closed stream, so a short wait may be needed.
   */
  async reconcile(id, expectAll) {
    let messages = [];
    for (let attempt = 0; attempt < 20; attempt++) {
      try {
        messages = (await api(`/api/conversations/${enc(id)}`)).messages || [];
      } catch {
        return;
      }
      if (!this.alive || this.id !== id || this.busy) return;
      if (!expectAll || messages.length >= this.items.length) break;
      await sleep(150);
    }
    if (messages.length > this.items.length
        || messages.some((m, i) => this.items[i] && this.items[i].role !== m.role)) {
      this.renderMessages(messages);      // changed elsewhere: show the server's version
      return;
    }
    this.items.forEach((item, i) => {
      const m = messages[i];
      if (!m) {                            // never stored (an engine error before any text)
        item.el.classList.add("unstored");
        return;
      }
      item.seq = m.seq;
      if (item.role === "assistant" && m.stats) item.stats.textContent = describeStats(m.stats, m.stopped);
    });
    this.items = this.items.filter((item) => !item.el.classList.contains("unstored"));
    this.refreshActions();
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  // -- settings ------------------------------------------------------------------------------
  wireSettings() {
    const form = byId("chat-settings");
    form.addEventListener("submit", (e) => e.preventDefault());
    const save = debounce(() => this.flushSettings(), 500);
    form.addEventListener("input", save);
    form.addEventListener("change", save);
    byId("response-format").addEventListener("change", () => {
      byId("schema-field").hidden = byId("response-format").value !== "json_schema";
    });
  }

  fillSettings(settings) {
    this.settings = { ...settings };
    byId("system").value = settings.system ?? "";
    byId("temperature").value = settings.temperature ?? "";
    byId("top-p").value = settings.top_p ?? "";
    byId("max-tokens").value = settings.max_tokens ?? "";
    byId("reasoning-effort").value = settings.reasoning_effort ?? "";
    const format = settings.response_format?.type;
    byId("response-format").value = format === "json_object" || format === "json_schema" ? format : "";
    const schema = settings.response_format?.json_schema?.schema;
    byId("json-schema").value = schema ? JSON.stringify(schema, null, 2) : "";
    byId("schema-field").hidden = format !== "json_schema";
    this.settingsStatus("Settings apply to this conversation only.", false);
  }

  settingsStatus(message, isError) {
    const status = byId("settings-status");
    status.textContent = message;
    status.classList.toggle("error-text", isError);
    if (isError) {                        // a problem must be seen even with the panel folded
      byId("chat-settings").hidden = false;
      byId("toggle-settings").setAttribute("aria-expanded", "true");
    }
  }

  /** The form as conversation settings, or throws an Error naming the field. */
  readSettings() {
    const out = {};
    const system = byId("system").value;
    if (system.trim()) out.system = system;
    for (const [id, key, parse] of [["temperature", "temperature", Number], ["top-p", "top_p", Number],
                                    ["max-tokens", "max_tokens", Number]]) {
      const raw = byId(id).value.trim();
      if (raw === "") continue;
      const value = parse(raw);
      if (!Number.isFinite(value)) throw new Error(`${key}: "${raw}" is not a number.`);
      out[key] = value;
    }
    const effort = byId("reasoning-effort").value;
    if (effort) out.reasoning_effort = effort;
    const format = byId("response-format").value;
    if (format === "json_object") out.response_format = { type: "json_object" };
    if (format === "json_schema") {
      let schema;
      try {
        schema = JSON.parse(byId("json-schema").value || "null");
      } catch (e) {
        throw new Error(`JSON schema: not valid JSON (${e.message}).`);
      }
      if (!schema || typeof schema !== "object") throw new Error("JSON schema: write a JSON object.");
      out.response_format = { type: "json_schema", json_schema: { name: "response", schema } };
    }
    return out;
  }

  /** Saves changed settings (to the server once the conversation exists); false when they are invalid. */
  async flushSettings() {
    let settings;
    try {
      settings = this.readSettings();
    } catch (e) {
      this.settingsStatus(e.message, true);
      return false;
    }
    if (JSON.stringify(settings) === JSON.stringify(this.settings)) return true;
    const id = this.id;
    if (!id) {
      this.settings = settings;
      this.settingsStatus("Saved with the conversation when you send.", false);
      return true;
    }
    try {
      await api(`/api/conversations/${enc(id)}`, { method: "PATCH", body: { settings } });
    } catch (e) {
      this.settingsStatus(`Not saved: ${e.message}`, true);
      return false;
    }
    if (this.id === id) {
      this.settings = settings;
      this.settingsStatus("Saved.", false);
    }
    return true;
  }
}

export function mount(root, params) {
  const view = new ChatView();
  view.open(params.id);
  return view;
}
