// The Models view: what the server can load (/api/models), load / switch / unload (with the
// server's memory admission answer shown as is), add a model by path, verify its checksums.
import { api } from "./api.js";
import { byId, fmtBytes, fmtInt, h, hide, show } from "./dom.js";

class ModelsView {
  constructor() {
    this.alive = true;
    this.working = false;
    this.models = [];
    byId("add-model").addEventListener("submit", (e) => { e.preventDefault(); this.add(); });
    this.load();
  }

  update() {}

  unmount() {
    this.alive = false;
    clearTimeout(this.poll);
  }

  status(text) {
    byId("models-status").textContent = text;
  }

  async load() {
    let answer;
    try {
      answer = await api("/api/models");
    } catch (e) {
      if (this.alive) show(byId("models-notice"), `Could not list the models: ${e.message}`);
      return;
    }
    if (!this.alive) return;
    this.models = answer.data || [];
    const loaded = answer.loaded;
    const where = loaded ? [loaded.mode, loaded.device, loaded.context && `${fmtInt(loaded.context)} context`]
      .filter(Boolean).join(", ") : "";
    byId("loaded-model").textContent = loaded ? `loaded: ${loaded.name}${where ? ` (${where})` : ""}`
      : "no model loaded";
    byId("loaded-model").classList.toggle("warn", !loaded);
    clearTimeout(this.poll);
    if (answer.switching && !this.working) {
      // another page (or client) is switching models: show it, and look again shortly
      this.status(`Switching to ${answer.switching.model ?? "another model"}…`);
      this.poll = setTimeout(() => this.load(), 1000);
    }
    this.busyElsewhere = !!answer.switching;
    const anyLoaded = this.models.some((m) => m.loaded);
    const body = byId("models-table").tBodies[0];
    if (!this.models.length) {
      body.replaceChildren(h("tr", {}, h("td", { colspan: 8, class: "hint" },
        "No models found. Add a GGUF file or a Hugging Face folder below.")));
      return;
    }
    body.replaceChildren(...this.models.map((m) => this.row(m, anyLoaded)));
  }

  row(m, anyLoaded) {
    const name = m.name || m.path;
    const actions = h("div", { class: "row-actions" });
    const idle = !this.busyElsewhere;
    if (m.loaded) {
      actions.append(h("button", { type: "button", class: "secondary small unload", disabled: !idle,
        "aria-label": `Unload ${name}`, onclick: () => this.unload(name) }, "Unload"));
    } else {
      actions.append(h("button", { type: "button", class: "small load", disabled: !idle || !!m.error,
        "aria-label": `${anyLoaded ? "Switch to" : "Load"} ${name}`,
        onclick: () => this.switchTo(name) }, anyLoaded ? "Switch to" : "Load"));
    }
    actions.append(h("button", { type: "button", class: "ghost small verify", disabled: !m.path || !!m.error,
      "aria-label": `Verify ${name}`, onclick: () => this.verify(name) }, "Verify"));
    return h("tr", { class: m.loaded ? "loaded" : "", dataset: { name } },
      h("td", {}, h("div", { class: "model-name" }, name, m.loaded ? h("span", { class: "badge ok" }, "loaded") : ""),
        h("div", { class: "model-path" }, m.path ?? ""),
        m.error ? h("div", { class: "model-error error-text" }, m.error) : ""),
      h("td", {}, m.family ?? ""), h("td", {}, m.quant ?? ""),
      h("td", { class: "num" }, fmtBytes(m.size_bytes)), h("td", { class: "num" }, fmtInt(m.context)),
      h("td", {}, m.source ?? ""),
      h("td", { class: "hash" }, m.sha256 ? h("code", { title: m.sha256 }, m.sha256.slice(0, 12) + "…") : "—"),
      h("td", {}, actions));
  }

  /** Runs one action at a time, with every action button disabled meanwhile. */
  async act(label, work) {
    if (this.working) return;
    this.working = true;
    hide(byId("models-notice"));
    this.status(label);
    for (const b of document.querySelectorAll("#models-table button, #add-model-button")) b.disabled = true;
    byId("models-table").setAttribute("aria-busy", "true");
    try {
      await work();
    } catch (e) {
      if (this.alive) show(byId("models-notice"), e.message);
      this.status("");
    } finally {
      this.working = false;
      byId("models-table").setAttribute("aria-busy", "false");
      if (this.alive) {
        for (const b of document.querySelectorAll("#add-model-button")) b.disabled = false;
        await this.load();
      }
    }
  }

  switchTo(name) {
    return this.act(`Loading ${name}… (requests in flight finish first)`, async () => {
      await api("/api/models/load", { method: "POST", body: { model: name } });
      this.status(`${name} is loaded.`);
      window.dispatchEvent(new Event("lodestar:model-changed"));
    });
  }

  unload(name) {
    return this.act(`Unloading ${name}…`, async () => {
      await api("/api/models/unload", { method: "POST" });
      this.status(`${name} is unloaded; the API answers 503 until a model is loaded.`);
      window.dispatchEvent(new Event("lodestar:model-changed"));
    });
  }

  add() {
    const input = byId("model-path");
    const path = input.value.trim();
    const name = byId("model-name").value.trim();
    if (!path) return undefined;
    return this.act(`Adding ${path}…`, async () => {
      const added = await api("/api/models/add", { method: "POST", body: { path, ...(name ? { name } : {}) } });
      input.value = "";
      byId("model-name").value = "";
      this.status(`Added ${added?.name ?? path}.`);
    });
  }

  verify(name) {
    const panel = byId("verify-result");
    return this.act(`Verifying ${name}: hashing its files…`, async () => {
      const r = await api("/api/models/verify", { method: "POST", body: { model: name } });
      const verdict = r.ok === true ? `${name}: every file matches its recorded SHA-256 (${r.source ?? "recorded"}).`
        : r.ok === false ? `${name} does NOT match its recorded SHA-256 (${r.source ?? "recorded"}).`
          : `${name}: hashed; there is no recorded SHA-256 to compare with.`;
      const files = (r.files || []).map((f) => h("li", { class: f.status === "ok" || f.status === "unchecked" ? "" : "bad" },
        h("code", {}, f.path), ` ${f.status}`, f.size !== null && f.size !== undefined ? `, ${fmtBytes(f.size)}` : ""));
      panel.replaceChildren(
        h("h2", { class: "section-title" }, `Verify ${name}`),
        h("p", { class: r.ok === false ? "error-text verdict" : r.ok ? "ok-text verdict" : "verdict" }, verdict),
        h("p", {}, "SHA-256: ", h("code", { class: "wrap" }, r.sha256 ?? "—")),
        r.expected ? h("p", {}, "Expected: ", h("code", { class: "wrap" }, r.expected)) : "",
        files.length > 1 ? h("ul", { class: "file-list" }, files) : "");
      panel.hidden = false;
      this.status(`Verified ${name}.`);
    });
  }
}

export function mount() {
  return new ModelsView();
}
