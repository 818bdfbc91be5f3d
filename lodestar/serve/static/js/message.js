// Messages on screen, shared by the Chat and Agent views: a user's text, and an answer that
// streams in as markdown with its reasoning folded away.
import { h, show } from "./dom.js";
import { renderMarkdown } from "./markdown.js";

/** "42 tokens · 31.5 tok/s · first token 120 ms · 7 of 30 prompt tokens cached". */
export function describeStats(stats, stopped) {
  const s = stats || {};
  const parts = stopped ? ["Stopped"] : [];
  const n = s.completion_tokens;
  if (n !== undefined && n !== null) parts.push(`${n} token${n === 1 ? "" : "s"}`);
  if (s.tokens_per_s) parts.push(`${Number(s.tokens_per_s).toFixed(1)} tok/s`);
  if (s.ttft_ms !== undefined && s.ttft_ms !== null) parts.push(`first token ${Math.round(s.ttft_ms)} ms`);
  if (s.prompt_tokens !== undefined && s.prompt_tokens !== null) {
    parts.push(`${s.cached_tokens ?? 0} of ${s.prompt_tokens} prompt tokens cached`);
  }
  if (s.finish_reason === "length") parts.push("cut off at the length limit");
  return parts.join(" · ");
}

// -- one message on screen ---------------------------------------------------------------
export class UserMessage {
  constructor(text) {
    this.role = "user";
    this.seq = null;
    this.content = text;
    this.body = h("div", { class: "body" }, text);
    this.actions = h("div", { class: "msg-actions" });
    this.el = h("article", { class: "msg user", "aria-label": "You" },
      h("div", { class: "role" }, "You"), this.body, this.actions);
  }
}

export class AssistantMessage {
  constructor() {
    this.role = "assistant";
    this.seq = null;
    this.content = "";
    this.reasoning = "";
    this.pending = false;
    this.summary = h("summary", {}, "Thinking…");
    this.reasoningBody = h("div", { class: "reasoning-body body" });
    this.details = h("details", { class: "reasoning", hidden: true }, this.summary, this.reasoningBody);
    this.body = h("div", { class: "body markdown" });
    this.error = h("div", { class: "error", role: "alert", hidden: true });
    this.stats = h("div", { class: "stats" });
    this.actions = h("div", { class: "msg-actions" });
    this.el = h("article", { class: "msg assistant", "aria-label": "Assistant", "aria-busy": "true" },
      h("div", { class: "role" }, "Assistant"), this.details, this.body, this.error, this.stats, this.actions);
  }

  add(kind, text) {
    this[kind === "reasoning" ? "reasoning" : "content"] += text;
    if (!this.pending) {                 // render at most once a frame
      this.pending = true;
      requestAnimationFrame(() => this.render());
    }
  }

  render() {
    this.pending = false;
    if (this.reasoning) {
      this.details.hidden = false;
      renderMarkdown(this.reasoningBody, this.reasoning);
    }
    renderMarkdown(this.body, this.content);
  }

  finish(statsText, error) {
    this.render();
    this.el.setAttribute("aria-busy", "false");
    this.summary.textContent = "Reasoning";
    this.stats.textContent = statsText;
    if (error) show(this.error, error);
  }

  static stored(message) {
    const m = new AssistantMessage();
    m.seq = message.seq;
    m.content = message.content || "";
    m.reasoning = message.reasoning || "";
    m.finish(describeStats(message.stats, message.stopped), null);
    return m;
  }
}
