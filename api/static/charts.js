"use strict";
// Small SVG charts for the dashboard, no library: vertical (optionally stacked) bars and
// horizontal bars. Every bar is a <rect> carrying data-category / data-series / data-value,
// so the page's own tests can read back what was drawn.
const Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#3b82f6", "#f59e0b", "#10b981", "#ef4444", "#8b5cf6", "#06b6d4", "#ec4899", "#84cc16",
                   "#64748b", "#d97706", "#0ea5e9", "#a855f7"];

  function node(name, attrs, parent) {
    const element = document.createElementNS(NS, name);
    for (const [key, value] of Object.entries(attrs || {})) element.setAttribute(key, value);
    if (parent) parent.appendChild(element);
    return element;
  }

  function text(parent, x, y, content, attrs) {
    const element = node("text", { x, y, ...attrs }, parent);
    element.textContent = content;
    return element;
  }

  // The top of the value axis: 1, 2 or 5 times a power of ten, at least `value`.
  function niceMax(value) {
    if (!(value > 0)) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    for (const step of [1, 2, 5, 10]) if (step * power >= value) return step * power;
    return 10 * power;
  }

  // Three significant digits, no exponent for the sizes a dashboard shows.
  function format(value) {
    if (value === 0) return "0";
    if (Math.abs(value) >= 100) return value.toFixed(0);
    return Number(value.toPrecision(3)).toString();
  }

  function colour(index) { return PALETTE[index % PALETTE.length]; }

  function empty(container, message) {
    container.replaceChildren();
    const p = document.createElement("p");
    p.className = "empty";
    p.textContent = message;
    container.appendChild(p);
  }

  function legend(container, names) {
    const box = document.createElement("div");
    box.className = "legend";
    names.forEach((name, index) => {
      const item = document.createElement("span");
      item.style.setProperty("--swatch", colour(index));
      item.textContent = name;
      box.appendChild(item);
    });
    container.appendChild(box);
  }

  // categories: ["2026-11-28", …]; series: [{name, values: [one number per category]}].
  function stackedBars(container, categories, series, options = {}) {
    if (!categories.length) return empty(container, options.emptyText || "no data yet");
    const width = 960, height = 280, left = 52, right = 12, top = 16, bottom = 40;
    const plotW = width - left - right, plotH = height - top - bottom;
    const totals = categories.map((_, i) => series.reduce((sum, s) => sum + (s.values[i] || 0), 0));
    const axisMax = niceMax(Math.max(...totals));
    const svg = node("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": options.label || "" });
    for (let tick = 0; tick <= 4; tick++) {
      const y = top + plotH - (plotH * tick) / 4;
      node("line", { x1: left, x2: width - right, y1: y, y2: y, class: tick ? "grid" : "axis" }, svg);
      text(svg, left - 6, y + 4, format((axisMax * tick) / 4), { "text-anchor": "end", class: "tick" });
    }
    const slot = plotW / categories.length;
    const barW = Math.max(4, Math.min(60, slot * 0.7));
    categories.forEach((category, i) => {
      const x = left + slot * i + (slot - barW) / 2;
      let y = top + plotH;
      series.forEach((s, k) => {
        const value = s.values[i] || 0;
        if (value <= 0) return;
        const h = (value / axisMax) * plotH;
        y -= h;
        const rect = node("rect", { x, y, width: barW, height: h, fill: colour(k), class: "bar",
          "data-category": category, "data-series": s.name, "data-value": value }, svg);
        node("title", {}, rect).textContent = `${category} ${s.name}: ${format(value)} ${options.unit || ""}`;
      });
      text(svg, x + barW / 2, y - 4, format(totals[i]), { "text-anchor": "middle", class: "total",
        "data-category": category });
      text(svg, x + barW / 2, top + plotH + 16, category, { "text-anchor": "middle", class: "category" });
    });
    container.replaceChildren(svg);
    legend(container, series.map((s) => s.name));
  }

  // items: [{label, value}], drawn largest first as horizontal bars with their values.
  function horizontalBars(container, items, options = {}) {
    if (!items.length) return empty(container, options.emptyText || "no data yet");
    const rowH = 24, left = 150, right = 60, top = 6, width = 520;
    const height = top * 2 + rowH * items.length;
    const plotW = width - left - right;
    const axisMax = Math.max(...items.map((item) => item.value)) || 1;  // the largest bar fills the width
    const svg = node("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": options.label || "" });
    node("line", { x1: left, x2: left, y1: top, y2: height - top, class: "axis" }, svg);
    items.forEach((item, i) => {
      const y = top + i * rowH + 4;
      const w = (item.value / axisMax) * plotW;
      const rect = node("rect", { x: left, y, width: w, height: rowH - 8, fill: colour(options.colourIndex || 0),
        class: "bar", "data-category": item.label, "data-value": item.value }, svg);
      node("title", {}, rect).textContent = `${item.title || item.label}: ${format(item.value)} ${options.unit || ""}`;
      const middle = { "dominant-baseline": "middle" };
      text(svg, left - 6, y + (rowH - 8) / 2, item.label, { ...middle, "text-anchor": "end", class: "category" });
      text(svg, left + w + 4, y + (rowH - 8) / 2, format(item.value), { ...middle, class: "value",
        "data-category": item.label });
    });
    container.replaceChildren(svg);
  }

  return { stackedBars, horizontalBars, format, niceMax };
})();
