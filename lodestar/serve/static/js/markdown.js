// Model text as markdown: markdown-it with raw HTML off (so the output holds only markdown-it's
// own tags, every piece of model text escaped), highlight.js for code, and a copy button per block.
import markdownit from "../vendor/markdown-it.min.js";
import hljs from "../vendor/highlight.min.js";

const md = markdownit({
  html: false,
  linkify: true,
  highlight(code, lang) {
    const language = lang && hljs.getLanguage(lang) ? lang : null;
    if (!language) return "";             // markdown-it escapes it
    try {
      return hljs.highlight(code, { language, ignoreIllegals: true }).value;
    } catch {
      return "";
    }
  },
});

// Links leave the app in a new tab and pass nothing about it along.
const renderLink = md.renderer.rules.link_open
  || ((tokens, idx, options, env, self) => self.renderToken(tokens, idx, options));
md.renderer.rules.link_open = (tokens, idx, options, env, self) => {
  tokens[idx].attrSet("target", "_blank");
  tokens[idx].attrSet("rel", "noopener noreferrer");
  return renderLink(tokens, idx, options, env, self);
};

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    // Not a secure context (a LAN address over http): the old selection route still works.
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    const ok = document.execCommand("copy");
    area.remove();
    return ok;
  }
}

/** A "Copy" button that copies what `getText()` returns and says so. */
export function copyButton(getText, label = "Copy") {
  const button = document.createElement("button");
  button.type = "button";
  button.className = "copy ghost small";
  button.textContent = label;
  button.addEventListener("click", async () => {
    const ok = await copyText(getText());
    button.textContent = ok ? "Copied" : "Copy failed";
    setTimeout(() => { button.textContent = label; }, 1500);
  });
  return button;
}

/** Renders `text` into `el`, replacing what was there. */
export function renderMarkdown(el, text) {
  el.innerHTML = md.render(text);          // safe: html:false, see the top of this file
  for (const pre of el.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    pre.classList.add("code-block");
    const button = copyButton(() => code?.textContent ?? pre.textContent);
    button.setAttribute("aria-label", "Copy code");
    pre.prepend(button);
  }
}
