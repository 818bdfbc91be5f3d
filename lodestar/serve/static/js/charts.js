// Small live line charts drawn as SVG paths (no chart library: a few paths and labels is all
// the dashboard needs). Colours come from CSS classes, so both themes apply.
import { fmt, h } from "./dom.js";

const SVG = "http://www.w3.org/2000/svg";   // the SVG namespace name, not a resource
const W = 300;
const H = 100;

function svg(tag, attrs = {}) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  return el;
}

/** 1, 2 or 5 times a power of ten, at least `x`: axis tops that read well. */
function niceCeil(x) {
  if (!(x > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(x));
  for (const m of [1, 2, 5, 10]) if (m * p >= x) return m * p;
  return 10 * p;
}

export class LineChart {
  /**
   * @param figure  a <figure> whose <figcaption> names the chart
   * @param series  [{key, label}] drawn in order; CSS colours them .series-0, .series-1 …
   * @param slots   how many samples fit across, at most (fewer samples are stretched over at least `minSlots`)
   */
  constructor(figure, series, slots = 120, minSlots = 30) {
    this.series = series;
    this.slots = slots;
    this.minSlots = minSlots;
    this.top = h("span", { class: "axis-top" });
    this.svg = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img",
      "aria-label": figure.querySelector("figcaption")?.textContent?.trim() || "chart" });
    for (const y of [0.25, 0.5, 0.75]) {
      this.svg.append(svg("line", { class: "grid", x1: 0, x2: W, y1: H * y, y2: H * y }));
    }
    this.paths = series.map((s, i) => {
      const path = svg("path", { class: `line series-${i}`, "data-series": s.key, d: "" });
      this.svg.append(path);
      return path;
    });
    const legend = series.length > 1
      ? h("ul", { class: "legend" }, series.map((s, i) => h("li", { class: `series-${i}` }, s.label)))
      : null;
    figure.append(h("div", { class: "plot" }, this.top, this.svg), legend || "");
    this.value = figure.querySelector(".chart-value");
  }

  /** Redraws from `samples` (oldest first), each an object holding every series' key. */
  update(samples, fixedMax = null) {
    const recent = samples.slice(-this.slots);
    let max = fixedMax;
    if (!max) {
      max = 0;
      for (const s of recent) for (const { key } of this.series) max = Math.max(max, s[key] ?? 0);
      max = niceCeil(max);
    }
    this.top.textContent = fmt(max);
    const span = Math.max(this.minSlots, recent.length);
    const step = W / (span - 1);
    const offset = span - recent.length;            // new samples enter on the right
    this.series.forEach(({ key }, i) => {
      let d = "";
      recent.forEach((s, j) => {
        const v = s[key];
        if (v === null || v === undefined) return;
        const x = (offset + j) * step;
        const y = H - (Math.min(v, max) / max) * H;
        d += `${d ? "L" : "M"}${x.toFixed(1)} ${y.toFixed(1)}`;
      });
      this.paths[i].setAttribute("d", d);
    });
    const last = recent.at(-1);
    if (this.value && last) {
      this.value.textContent = this.series.map(({ key }) => fmt(last[key])).join(" / ");
    }
  }
}
