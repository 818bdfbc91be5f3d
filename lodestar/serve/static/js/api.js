// Talking to the server: JSON requests and server-sent event streams, with the API key as a
// Bearer token. EventSource cannot send headers, so streams are read from fetch bodies.

const KEY = "lodestar.apiKey";

export function apiKey() {
  try { return localStorage.getItem(KEY) || ""; } catch { return ""; }
}

export function setApiKey(value) {
  try {
    if (value) localStorage.setItem(KEY, value);
    else localStorage.removeItem(KEY);
  } catch { /* storage disabled: the key then lasts for this page only */ }
  sessionKey = value;
}

let sessionKey = null;   // the key when local storage is unavailable
const currentKey = () => apiKey() || sessionKey || "";

export class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function headers(json) {
  const out = {};
  if (json) out["Content-Type"] = "application/json";
  const key = currentKey();
  if (key) out.Authorization = "Bearer " + key;
  return out;
}

async function failure(res) {
  let text = "";
  let code = null;
  try {
    text = await res.text();
    const error = JSON.parse(text)?.error;
    if (error?.message) return new ApiError(res.status, error.message, error.code ?? null);
  } catch { /* not JSON: show the raw text */ }
  return new ApiError(res.status, `HTTP ${res.status} ${res.statusText}${text ? ": " + text.slice(0, 300) : ""}`, code);
}

async function send(path, { method = "GET", body, signal } = {}) {
  let res;
  try {
    res = await fetch(path, {
      method, signal, headers: headers(body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, `Cannot reach the server (${e.message}). Is lodestar serve still running?`);
  }
  if (!res.ok) {
    const error = await failure(res);
    // The page asks for the key once; every view retries when it is given.
    if (res.status === 401) window.dispatchEvent(new CustomEvent("lodestar:auth", { detail: error.message }));
    throw error;
  }
  return res;
}

/** The parsed JSON answer (null for 204); an ApiError carrying the server's message otherwise. */
export async function api(path, options = {}) {
  const res = await send(path, options);
  if (res.status === 204) return null;
  const text = await res.text();
  return text ? JSON.parse(text) : null;
}

/** The body as text (for pages such as /report). */
export async function apiText(path, options = {}) {
  return (await send(path, options)).text();
}

/**
 * Server-sent events of a request as `{event, data}` (data parsed as JSON when it is JSON).
 * Aborting `signal` closes the stream, which is how the server learns to stop.
 */
export async function* events(path, options = {}) {
  const res = await send(path, options);
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (!data.length) continue;          // ": keep-alive" comments carry no data
        const text = data.join("\n");
        let parsed = text;
        try { parsed = JSON.parse(text); } catch { /* plain text data */ }
        yield { event, data: parsed };
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}
