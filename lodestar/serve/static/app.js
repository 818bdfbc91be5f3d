// lodestar web chat: streams /v1/chat/completions and renders the reply as markdown.
"use strict";

const $ = (id) => document.getElementById(id);

// -- settings kept in localStorage --------------------------------------------------------
const store = {
  get(key, fallback = "") {
    try { return localStorage.getItem("lodestar." + key) ?? fallback; } catch { return fallback; }
  },
  set(key, value) {
    try {
      if (value) localStorage.setItem("lodestar." + key, value);
      else localStorage.removeItem("lodestar." + key);
    } catch { /* storage may be disabled; settings then last for the page only */ }
  },
};

// -- markdown -----------------------------------------------------------------------------
// Every piece of model text is HTML-escaped; the renderer only ever adds its own tags.
const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESCAPES[c]);

function emphasis(html) {
  return html
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?![*\w])/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
}

const link = (url, labelHtml) => `<a href="${escapeHtml(url)}" target="_blank" rel="noopener noreferrer">${labelHtml}</a>`;

function renderInline(text) {
  const held = [];                          // finished HTML, kept away from the later rules
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let s = text.replace(/\u0000/g, "");
  s = s.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, __, code) => hold(`<code>${escapeHtml(code)}</code>`));
  s = s.replace(/\[([^\]\n]+)\]\(((?:https?:\/\/|mailto:)[^\s)]+)\)/g,
    (_, label, url) => hold(link(url, emphasis(escapeHtml(label)))));
  s = s.replace(/\bhttps?:\/\/[^\s<>"'`\u0000]*[^\s<>"'`.,:;!?)\]\u0000]/g, (url) => hold(link(url, escapeHtml(url))));
  s = emphasis(escapeHtml(s));
  for (let i = 0; i < 2 && s.includes("\u0000"); i++) {   // a link label may hold a code span
    s = s.replace(/\u0000(\d+)\u0000/g, (_, n) => held[+n]);
  }
  return s;
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}>\s?/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_SEP = /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/;
const indentOf = (line) => line.match(/^\s*/)[0].replace(/\t/g, "    ").length;

function startsBlock(line, next) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line)
    || (line.includes("|") && next !== undefined && TABLE_SEP.test(next));
}

function tableCells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

function renderList(lines, i) {
  const first = lines[i].match(ITEM);
  const indent = indentOf(first[1]);
  const ordered = /\d/.test(first[2]);
  const items = [];
  while (i < lines.length) {
    const line = lines[i];
    const m = line.match(ITEM);
    if (m && indentOf(m[1]) <= indent + 1) {
      if (/\d/.test(m[2]) !== ordered) break;
      items.push([m[3]]);
      i++;
    } else if (line.trim() === "") {
      let j = i + 1;
      while (j < lines.length && lines[j].trim() === "") j++;
      const next = lines[j];
      const sameList = next !== undefined && ITEM.test(next) && indentOf(next) <= indent + 1
        && /\d/.test(next.match(ITEM)[2]) === ordered;
      if (next === undefined || (indentOf(next) <= indent && !sameList)) break;
      items[items.length - 1].push("");
      i++;
    } else if (indentOf(line) > indent) {
      items[items.length - 1].push(line.slice(Math.min(indentOf(line), indent + 4)));
      i++;
    } else if (!startsBlock(line, lines[i + 1]) && items[items.length - 1].at(-1) !== "") {
      items[items.length - 1].push(line.trim());   // a lazy continuation line
      i++;
    } else {
      break;
    }
  }
  const start = ordered ? parseInt(first[2], 10) : 1;
  const tag = ordered ? "ol" : "ul";
  const open = ordered && start !== 1 ? `<ol start="${start}">` : `<${tag}>`;
  const body = items.map((item) => {
    const loose = item.slice(0, -1).includes("");
    return `<li>${renderBlocks(item, !loose)}</li>`;
  }).join("");
  return [`${open}${body}</${tag}>`, i];
}

function renderBlocks(lines, tight = false) {
  let html = "";
  let para = [];
  const flush = () => {
    if (!para.length) return;
    const inner = para.map(renderInline).join("<br>");
    html += tight ? inner : `<p>${inner}</p>`;
    para = [];
  };
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {
      flush();
      const marker = m[1];
      const lang = m[2];
      const code = [];
      i++;
      while (i < lines.length && !(lines[i].trim().startsWith(marker[0].repeat(marker.length))
                                   && lines[i].trim().replace(new RegExp(`\\${marker[0]}`, "g"), "") === "")) {
        code.push(lines[i]);
        i++;
      }
      i++;                                   // the closing fence (absent while a reply still streams)
      const cls = lang ? ` class="language-${escapeHtml(lang)}"` : "";
      html += `<pre><code${cls}>${escapeHtml(code.join("\n"))}</code></pre>`;
    } else if (line.trim() === "") {
      flush();
      i++;
    } else if ((m = line.match(HEADING))) {
      flush();
      const level = Math.min(m[1].length + 2, 6);
      html += `<h${level}>${renderInline(m[2])}</h${level}>`;
      i++;
    } else if (RULE.test(line)) {
      flush();
      html += "<hr>";
      i++;
    } else if (QUOTE.test(line)) {
      flush();
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) quoted.push(lines[i++].replace(QUOTE, ""));
      html += `<blockquote>${renderBlocks(quoted)}</blockquote>`;
    } else if (ITEM.test(line)) {
      flush();
      const [list, next] = renderList(lines, i);
      html += list;
      i = next;
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
      flush();
      const head = tableCells(line);
      let rows = "";
      i += 2;
      while (i < lines.length && lines[i].includes("|") && lines[i].trim() !== "") {
        rows += `<tr>${tableCells(lines[i]).map((c) => `<td>${renderInline(c)}</td>`).join("")}</tr>`;
        i++;
      }
      html += `<table><thead><tr>${head.map((c) => `<th>${renderInline(c)}</th>`).join("")}</tr></thead>`
            + `<tbody>${rows}</tbody></table>`;
    } else {
      para.push(line);
      i++;
    }
  }
  flush();
  return html;
}

function renderMarkdown(text) {
  return renderBlocks(text.replace(/\r\n?/g, "\n").split("\n"));
}

// -- server-sent events -------------------------------------------------------------------
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (data) yield data;                // ": keep-alive" comments carry no data
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// -- talking to the server ----------------------------------------------------------------
class ServerError extends Error {}

function requestHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

async function errorMessage(res) {
  let text = "";
  try {
    text = await res.text();
    const body = JSON.parse(text);
    const message = body?.error?.message;
    if (message) return message;
  } catch { /* not JSON: show the raw text */ }
  return `HTTP ${res.status} ${res.statusText}${text ? ": " + text.slice(0, 300) : ""}`;
}

function showNotice(message) {
  const notice = $("notice");
  notice.textContent = message;
  notice.hidden = false;
}

function clearNotice() {
  $("notice").hidden = true;
  $("notice").textContent = "";
}

async function loadModels() {
  const select = $("model");
  const wanted = select.value || store.get("model");
  let res;
  try {
    res = await fetch("/v1/models", { headers: requestHeaders() });
  } catch (e) {
    showNotice(`Cannot reach the server: ${e.message}`);
    return;
  }
  if (!res.ok) {
    const message = await errorMessage(res);
    const hint = res.status === 401 ? " Enter the server's API key in the sidebar." : "";
    showNotice(`Could not list the models: ${message}${hint}`);
    select.replaceChildren();
    return;
  }
  const models = (await res.json()).data || [];
  select.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
  if (models.some((m) => m.id === wanted)) select.value = wanted;
  clearNotice();
}

// -- the conversation ---------------------------------------------------------------------
const chat = {
  messages: [],          // what the next request sends after the system prompt
  controller: null,      // the reply being streamed
};

function nearBottom() {
  const log = $("log");
  return log.scrollHeight - log.scrollTop - log.clientHeight < 80;
}

function scrollDown(force = false) {
  const log = $("log");
  if (force || nearBottom()) log.scrollTop = log.scrollHeight;
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function addUserMessage(text) {
  $("empty").hidden = true;
  const article = element("article", "msg user");
  article.setAttribute("aria-label", "You");
  article.append(element("div", "role", "You"), element("div", "body", text));
  $("log").append(article);
  scrollDown(true);
  return article;
}

class Reply {
  constructor(model) {
    this.el = element("article", "msg assistant");
    this.el.setAttribute("aria-label", model);
    this.el.setAttribute("aria-busy", "true");
    this.details = element("details", "reasoning");
    this.details.hidden = true;
    this.summary = element("summary", "", "Thinking…");
    this.reasoningBody = element("div", "reasoning-body body");
    this.details.append(this.summary, this.reasoningBody);
    this.body = element("div", "body markdown");
    this.error = element("div", "error");
    this.error.setAttribute("role", "alert");
    this.error.hidden = true;
    this.stats = element("div", "stats");
    this.el.append(element("div", "role", model), this.details, this.body, this.error, this.stats);
    $("log").append(this.el);
    this.content = "";
    this.reasoning = "";
    this.pending = false;
    scrollDown(true);
  }

  add(kind, text) {
    this[kind] += text;
    if (!this.pending) {                     // render at most once a frame
      this.pending = true;
      requestAnimationFrame(() => this.render());
    }
  }

  render() {
    this.pending = false;
    const follow = nearBottom();
    if (this.reasoning) {
      this.details.hidden = false;
      this.reasoningBody.innerHTML = renderMarkdown(this.reasoning);
    }
    this.body.innerHTML = renderMarkdown(this.content);
    if (follow) scrollDown(true);
  }

  finish(stats, error) {
    this.render();
    this.el.setAttribute("aria-busy", "false");
    this.summary.textContent = "Reasoning";
    this.stats.textContent = stats;
    if (error) {
      this.error.textContent = error;
      this.error.hidden = false;
    }
    scrollDown();
  }
}

function setStreaming(controller) {
  chat.controller = controller;
  $("stop").disabled = !controller;
  $("send").disabled = !!controller;
}

function describe(usage, times, finish) {
  const parts = [];
  if (usage) {
    const n = usage.completion_tokens;
    parts.push(`${n} token${n === 1 ? "" : "s"}`);
    const decode = (times.last - times.first) / 1000;
    if (n > 1 && decode > 0) parts.push(`${((n - 1) / decode).toFixed(1)} tok/s`);
  }
  if (times.first !== null) parts.push(`first token ${Math.round(times.first - times.start)} ms`);
  if (usage) {
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  }
  if (finish === "length") parts.push("cut off at the length limit");
  return parts.join(" · ");
}

async function send() {
  const input = $("prompt");
  const text = input.value;
  if (!text.trim() || chat.controller) return;
  const model = $("model").value;
  if (!model) {
    showNotice("No model to send to: the model list did not load. Set the API key if the server needs one.");
    return;
  }
  input.value = "";
  const turn = { role: "user", content: text };
  const history = chat.messages;          // "New chat" starts another list; this turn stays in its own
  history.push(turn);
  const userEl = addUserMessage(text);
  const reply = new Reply(model);
  const system = $("system").value.trim();
  const body = {
    model, stream: true, stream_options: { include_usage: true },
    messages: [...(system ? [{ role: "system", content: system }] : []), ...history],
  };
  const temperature = $("temperature").value.trim();
  const maxTokens = $("max-tokens").value.trim();
  if (temperature !== "") body.temperature = Number(temperature);   // the server checks the range
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  const controller = new AbortController();
  setStreaming(controller);
  const times = { start: performance.now(), first: null, last: null };
  let usage = null, finish = null, error = null, stopped = false;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: requestHeaders(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!res.ok) throw new ServerError(await errorMessage(res));
    for await (const data of sseData(res.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ServerError(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      for (const [field, kind] of [["reasoning_content", "reasoning"], ["content", "content"]]) {
        if (delta[field]) {
          times.last = performance.now();
          if (times.first === null) times.first = times.last;
          reply.add(kind, delta[field]);
        }
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true;
    else if (e instanceof ServerError) error = e.message;
    else error = `The request failed: ${e.message}`;
  } finally {
    setStreaming(null);
  }
  if (error) {
    // The failed turn leaves the history; its text goes back to the composer for a retry.
    history.splice(history.indexOf(turn), 1);
    userEl.classList.add("unsent");
    if (!input.value) input.value = text;
  } else if (reply.content || !stopped) {
    history.push({ role: "assistant", content: reply.content });
  } else {
    history.splice(history.indexOf(turn), 1);   // stopped before any answer
  }
  const stats = stopped ? ["Stopped", describe(null, times, null)].filter(Boolean).join(" · ")
                        : describe(usage, times, finish);
  reply.finish(stats, error);
  input.focus();
}

function stop() {
  if (chat.controller) chat.controller.abort();
}

function newChat() {
  stop();
  chat.messages = [];
  for (const el of [...$("log").querySelectorAll(".msg")]) el.remove();
  $("empty").hidden = false;
  clearNotice();
  $("prompt").focus();
}

// -- wiring -------------------------------------------------------------------------------
function init() {
  $("api-key").value = store.get("apiKey");
  for (const [id, key] of [["system", "system"], ["temperature", "temperature"], ["max-tokens", "maxTokens"]]) {
    $(id).value = store.get(key);
    $(id).addEventListener("input", () => store.set(key, $(id).value));
  }
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && chat.controller) stop();
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("model").addEventListener("change", () => store.set("model", $("model").value));
  $("api-key").addEventListener("change", () => {
    store.set("apiKey", $("api-key").value.trim());
    loadModels();
  });
  loadModels();
  $("prompt").focus();
}

init();
