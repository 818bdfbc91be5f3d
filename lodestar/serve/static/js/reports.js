// The Reports view: the server's benchmark report (/report) in a sandboxed frame. The page is
// fetched with the API key (a frame's own request could not carry it) and shown with scripts off.
import { apiText } from "./api.js";
import { byId, show } from "./dom.js";

class ReportView {
  constructor() {
    this.alive = true;
    this.load();
  }

  update() {}

  unmount() {
    this.alive = false;
  }

  async load() {
    const frame = byId("report-frame");
    try {
      const html = await apiText("/report");
      if (this.alive) frame.srcdoc = html;
    } catch (e) {
      if (!this.alive) return;
      frame.hidden = true;
      const hint = e.status === 404 ? " Run a benchmark (lodestar bench …) or start the server with --bench-results DIR." : "";
      show(byId("report-notice"), `No report to show: ${e.message}${hint}`);
    }
  }
}

export function mount() {
  return new ReportView();
}
