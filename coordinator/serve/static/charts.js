// SVG for the swarm's map: a grid of layers x experts whose cells keep their elements between updates (a
// 40 x 256 model is ten thousand cells: only a cell whose look changed is touched), and small line charts.
"use strict";

const SwarmCharts = (() => {
  const NS = "http://www.w3.org/2000/svg";

  function svg(tag, attrs, text) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  class Grid {
    constructor(host) {
      this.host = host;
      this.shape = "";
      this.cells = [];
    }

    // look(row, expert) -> [class, opacity or null, tooltip]
    update(layers, experts, look) {
      const shape = `${layers.join(",")}x${experts}`;
      if (shape !== this.shape) this.build(layers, experts);
      for (let r = 0; r < layers.length; r++) {
        for (let e = 0; e < experts; e++) {
          const cell = this.cells[r][e];
          const [cls, opacity, tip] = look(r, e);
          if (cell.cls !== cls) {
            cell.rect.setAttribute("class", cls);
            cell.cls = cls;
          }
          if (cell.opacity !== opacity) {
            if (opacity === null) cell.rect.removeAttribute("fill-opacity");
            else cell.rect.setAttribute("fill-opacity", opacity.toFixed(2));
            cell.opacity = opacity;
          }
          if (cell.tip !== tip) {
            cell.title.textContent = tip;
            cell.tip = tip;
          }
        }
      }
    }

    build(layers, experts) {
      this.shape = `${layers.join(",")}x${experts}`;
      const label = 30;
      const width = Math.max(200, this.host.clientWidth || 600);
      const w = Math.max(2, Math.min(18, Math.floor((width - label) / Math.max(1, experts))));
      const h = Math.max(3, Math.min(18, w));
      const gap = w >= 5 ? 1 : 0;
      const root = svg("svg", { width: label + experts * w, height: layers.length * h + 14, role: "img" });
      const every = Math.max(1, Math.ceil(12 / h));
      this.cells = layers.map((layer, r) => {
        if (r % every === 0) {
          root.append(svg("text", { x: label - 4, y: r * h + h - 1, class: "axis", "text-anchor": "end" }, layer));
        }
        const row = [];
        for (let e = 0; e < experts; e++) {
          const rect = svg("rect", {
            x: label + e * w, y: r * h, width: w - gap, height: h - gap, "data-layer": layer, "data-expert": e,
          });
          const title = svg("title");
          rect.append(title);
          root.append(rect);
          row.push({ rect, title, cls: null, opacity: null, tip: null });
        }
        return row;
      });
      const step = Math.max(1, Math.ceil(40 / w));
      for (let e = 0; e < experts; e += step) {
        root.append(svg("text", { x: label + e * w, y: layers.length * h + 12, class: "axis" }, e));
      }
      this.host.replaceChildren(root);
    }
  }

  // A line over the last `span` seconds: xs are seconds ago, ys values (null: none then, not drawn).
  function line(host, xs, ys, opts) {
    // the last five minutes, or since the server started when that is less (whole minutes)
    const span = opts.span || 60 * Math.min(5, Math.max(1, Math.ceil(Math.max(0, ...xs) / 60)));
    const width = Math.max(200, host.clientWidth || 400);
    const height = 120;
    const pad = { l: 40, r: 8, t: 8, b: 18 };
    const vals = ys.filter((y) => y !== null && y !== undefined);
    const top = niceMax(Math.max(opts.min || 0, ...vals));
    const x = (ago) => pad.l + (width - pad.l - pad.r) * (1 - Math.min(ago, span) / span);
    const y = (v) => pad.t + (height - pad.t - pad.b) * (1 - v / top);
    const root = svg("svg", { width, height, class: `line ${opts.kind || ""}`, role: "img" });
    for (const v of [0, top / 2, top]) {
      root.append(svg("line", { x1: pad.l, x2: width - pad.r, y1: y(v), y2: y(v), class: "rule" }));
      root.append(svg("text", { x: pad.l - 4, y: y(v) + 4, class: "axis", "text-anchor": "end" }, fmt(v)));
    }
    root.append(svg("text", { x: pad.l, y: height - 4, class: "axis" }, `${Math.round(span / 60)} min ago`));
    root.append(svg("text", { x: width - pad.r, y: height - 4, class: "axis", "text-anchor": "end" }, "now"));
    let path = "";
    let pen = false;
    for (let i = 0; i < xs.length; i++) {
      if (xs[i] > span || ys[i] === null || ys[i] === undefined) {
        pen = false;
        continue;
      }
      path += `${pen ? "L" : "M"}${x(xs[i]).toFixed(1)},${y(ys[i]).toFixed(1)}`;
      pen = opts.joined !== false;
      if (opts.joined === false) {
        root.append(svg("circle", { cx: x(xs[i]), cy: y(ys[i]), r: 2.5, class: "dot" }));
      }
    }
    if (path && opts.joined !== false) root.append(svg("path", { d: path, class: "stroke" }));
    const last = vals.length ? vals[vals.length - 1] : null;
    root.append(svg("text", { x: width - pad.r, y: pad.t + 10, class: "value", "text-anchor": "end" },
      last === null ? "–" : fmt(last)));
    host.replaceChildren(root);
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
    return 10 * p;
  }

  function fmt(v) {
    return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2);
  }

  return { Grid, line };
})();
