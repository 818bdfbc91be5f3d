// Building DOM from data without ever parsing it as HTML, and formatting numbers for people.

/** An element: `h("a", {href, class: "x", onclick}, "text", child)`. Strings become text nodes. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") el.className = value;
    else if (name === "text") el.textContent = value;
    else if (name.startsWith("on") && typeof value === "function") el.addEventListener(name.slice(2), value);
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (value === true) el.setAttribute(name, "");
    else el.setAttribute(name, String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export const byId = (id) => document.getElementById(id);

export function show(el, message) {
  el.textContent = message;
  el.hidden = false;
}

export function hide(el) {
  el.hidden = true;
  el.textContent = "";
}

const number = new Intl.NumberFormat(undefined, { maximumFractionDigits: 1 });
export const fmt = (n) => (n === null || n === undefined || Number.isNaN(n) ? "—" : number.format(n));
export const fmtInt = (n) => (n === null || n === undefined ? "—" : Math.round(n).toLocaleString());
export const fmtPercent = (x) => (x === null || x === undefined ? "—" : `${(x * 100).toFixed(1)}%`);

export function fmtBytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

const relative = new Intl.RelativeTimeFormat(undefined, { numeric: "auto" });

/** "3 minutes ago" for a Unix time in seconds. */
export function fmtAgo(seconds) {
  if (!seconds) return "";
  const diff = seconds - Date.now() / 1000;
  for (const [unit, size] of [["day", 86400], ["hour", 3600], ["minute", 60]]) {
    if (Math.abs(diff) >= size) return relative.format(Math.round(diff / size), unit);
  }
  return relative.format(0, "minute");
}

export const fmtClock = (seconds) => (seconds ? new Date(seconds * 1000).toLocaleTimeString() : "—");

/** Calls `fn` once input has paused for `ms`. */
export function debounce(fn, ms) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}

/** Enter sends, Shift+Enter adds a line (and an IME composition is left alone). */
export function submitOnEnter(textarea, submit) {
  textarea.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submit();
    }
  });
}
