// The app shell: hash routes to views, the colour theme, the API key dialog and the served model.
import { api, apiKey, setApiKey } from "./api.js";
import { byId } from "./dom.js";
import * as chat from "./chat.js";
import * as agent from "./agent.js";
import * as dashboard from "./dashboard.js";
import * as models from "./models.js";
import * as reports from "./reports.js";

// #/chat/ID, #/agent/ID, #/stats, #/models, #/report
const VIEWS = { chat, agent, stats: dashboard, models, report: reports };

function parseRoute() {
  const [name, ...rest] = location.hash.replace(/^#\/?/, "").split("/");
  const view = VIEWS[name] ? name : "chat";
  return { view, id: rest.length ? decodeURIComponent(rest.join("/")) : null };
}

const router = { name: null, view: null };

function route(force = false) {
  const { view: name, id } = parseRoute();
  for (const link of document.querySelectorAll(".views-nav a")) {
    if (link.dataset.view === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  if (!force && router.name === name && router.view) {
    router.view.update({ id });             // same view, another item: keep the view's state
    return;
  }
  router.view?.unmount();
  const root = byId("view");
  root.replaceChildren(byId(`view-${name}`).content.cloneNode(true));
  router.name = name;
  router.view = VIEWS[name].mount(root, { id });
  document.title = `${root.querySelector("h1")?.textContent ?? name} · lodestar`;
}

// -- theme: follows the system unless the toggle picked one -----------------------------
const THEMES = ["auto", "light", "dark"];
const THEME_KEY = "lodestar.theme";

function applyTheme(theme) {
  if (theme === "auto") delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  const button = byId("theme-toggle");
  const words = { auto: "follows the system", light: "light", dark: "dark" };
  button.setAttribute("aria-label", `Colour theme: ${words[theme]}. Change`);
  button.title = `Theme: ${theme}`;
  button.textContent = { auto: "◐", light: "☀", dark: "☾" }[theme];
}

function storedTheme() {
  try { return THEMES.includes(localStorage.getItem(THEME_KEY)) ? localStorage.getItem(THEME_KEY) : "auto"; }
  catch { return "auto"; }
}

function cycleTheme() {
  const next = THEMES[(THEMES.indexOf(storedTheme()) + 1) % THEMES.length];
  try { localStorage.setItem(THEME_KEY, next); } catch { /* this page only */ }
  applyTheme(next);
}

// -- API key ---------------------------------------------------------------------------
function askForKey(reason) {
  const dialog = byId("key-dialog");
  if (dialog.open) return;
  byId("key-reason").textContent = reason || "";
  byId("api-key").value = apiKey();
  dialog.showModal();
  byId("api-key").focus();
}

function onKeyDialogClose() {
  const dialog = byId("key-dialog");
  if (dialog.returnValue !== "save") return;
  setApiKey(byId("api-key").value.trim());
  showServedModel();
  route(true);                                  // every view loads again with the key
}

// -- the model the server answers with -----------------------------------------------------
async function showServedModel() {
  const label = byId("served-model");
  try {
    const data = (await api("/v1/models")).data || [];
    label.textContent = data.length ? data[0].id : "no model";
  } catch (e) {
    label.textContent = e.status === 503 ? "no model loaded" : "";
  }
}

function init() {
  applyTheme(storedTheme());
  byId("theme-toggle").addEventListener("click", cycleTheme);
  byId("key-button").addEventListener("click", () => askForKey(""));
  byId("key-dialog").addEventListener("close", onKeyDialogClose);
  window.addEventListener("lodestar:auth", (e) => askForKey(`${e.detail} Enter the key to continue.`));
  window.addEventListener("lodestar:model-changed", showServedModel);
  window.addEventListener("hashchange", () => route());
  showServedModel();
  route();
}

init();
