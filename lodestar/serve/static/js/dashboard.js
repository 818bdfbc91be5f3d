// The Dashboard view: polls /api/stats every second; live charts, totals and the last requests.
import { api } from "./api.js";
import { LineChart } from "./charts.js";
import { byId, fmt, fmtClock, fmtInt, fmtPercent, h, hide, show } from "./dom.js";

const POLL_MS = 1000;
const KEEP = 120;                    // two minutes of samples
const SAVED = "lodestar.statsSamples";

// The samples outlive a visit to another view (or a reload) in this tab, so the charts do not
// start empty each time; they are kept per tab and per server (origin).
function restore() {
  try {
    const samples = JSON.parse(sessionStorage.getItem(SAVED) || "[]");
    return Array.isArray(samples) ? samples.slice(-KEEP) : [];   // the next sample drops the stale ones
  } catch {
    return [];
  }
}

function save(samples) {
  try { sessionStorage.setItem(SAVED, JSON.stringify(samples)); } catch { /* the charts start empty next time */ }
}

class Dashboard {
  constructor() {
    this.alive = true;
    this.timer = null;
    this.samples = restore();
    this.charts = {
      decode: new LineChart(byId("chart-decode"), [{ key: "decode", label: "tok/s" }], KEEP),
      load: new LineChart(byId("chart-load"),
        [{ key: "running", label: "running" }, { key: "waiting", label: "waiting" }], KEEP),
      kv: new LineChart(byId("chart-kv"), [{ key: "kv", label: "blocks used" }], KEEP),
      ttft: new LineChart(byId("chart-ttft"), [{ key: "ttft", label: "ms" }], KEEP),
    };
    this.kvTotal = null;
    if (this.samples.length) this.draw();
    this.tick();
  }

  update() {}

  draw() {
    this.charts.decode.update(this.samples);
    this.charts.load.update(this.samples);
    this.charts.kv.update(this.samples, this.kvTotal);
    this.charts.ttft.update(this.samples);
  }

  unmount() {
    this.alive = false;
    clearTimeout(this.timer);
  }

  async tick() {
    if (!this.alive) return;
    if (!document.hidden) {              // a background tab does not need to load the server
      try {
        this.render(await api("/api/stats"));
        hide(byId("stats-notice"));
      } catch (e) {
        if (this.alive) show(byId("stats-notice"), `Could not read the server's stats: ${e.message}`);
      }
    }
    if (this.alive) this.timer = setTimeout(() => this.tick(), POLL_MS);
  }

  render(stats) {
    if (!this.alive) return;
    const engine = stats.engine || {};
    const rates = stats.rates || {};
    this.samples.push({
      t: stats.time,
      decode: rates.decode_tok_s ?? 0, running: engine.running ?? 0, waiting: engine.waiting ?? 0,
      kv: engine.kv_blocks_used ?? 0, ttft: rates.ttft_ms_p50 ?? null,
    });
    // the server's clock, not the browser's: only the last two minutes stay
    this.samples = this.samples.filter((x) => x.t >= stats.time - KEEP * POLL_MS / 1000).slice(-KEEP);
    save(this.samples);
    this.kvTotal = engine.kv_blocks_total || null;
    this.draw();
    this.renderTiles(stats);
    this.renderRequests(stats.requests || []);
    byId("stats-updated").textContent = `updated ${fmtClock(stats.time)}`;
  }

  renderTiles(stats) {
    const c = stats.counters || {};
    const engine = stats.engine || {};
    const tiles = [
      ["Requests", fmtInt(c.requests)],
      ["Prompt tokens", fmtInt(c.prompt_tokens)],
      ["Generated tokens", fmtInt(c.generation_tokens)],
      ["Cached prompt tokens", fmtInt(c.cached_tokens)],
      ["Prefix-cache hit rate", fmtPercent(stats.prefix_cache_hit_rate)],
      ["Speculative acceptance", fmtPercent(stats.spec_acceptance)],
      ["Grammar-forced tokens", fmtInt(c.forced_tokens)],
      ["KV blocks", `${fmtInt(engine.kv_blocks_used)} / ${fmtInt(engine.kv_blocks_total)}`],
    ];
    byId("stat-tiles").replaceChildren(...tiles.map(([label, value]) =>
      h("div", { class: "tile" }, h("dt", {}, label), h("dd", {}, value))));
  }

  renderRequests(requests) {
    const rows = [...requests].sort((a, b) => (b.started ?? 0) - (a.started ?? 0)).map((r) =>
      h("tr", { dataset: { id: r.id ?? "" } },
        h("td", {}, fmtClock(r.started)), h("td", {}, r.route ?? ""), h("td", {}, r.model ?? ""),
        h("td", { class: "num" }, fmtInt(r.prompt_tokens)), h("td", { class: "num" }, fmtInt(r.cached_tokens)),
        h("td", { class: "num" }, fmtInt(r.completion_tokens)), h("td", { class: "num" }, fmtInt(r.ttft_ms)),
        h("td", { class: "num" }, fmt(r.decode_tok_s)), h("td", {}, r.finish_reason ?? ""),
        h("td", { class: "num" }, fmtPercent(r.spec_acceptance))));
    const body = byId("requests-table").tBodies[0];
    if (!rows.length) {
      body.replaceChildren(h("tr", {}, h("td", { colspan: 10, class: "hint" }, "No finished requests yet.")));
    } else {
      body.replaceChildren(...rows);
    }
  }
}

export function mount() {
  return new Dashboard();
}
