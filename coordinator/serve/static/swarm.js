// The swarm's live map: /swarm.json read every second (the structure `swarm status --json` prints, plus the
// server's own figures), drawn as the nodes' table, the coverage grid, the routing load, two charts and the
// requests in flight. Nothing is kept here but the last answer.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const REFRESH_MS = 1000;
  const view = (window.swarmMap = { data: null, updated: null, error: null });
  const grid = { holders: null, routing: null };
  let keybar = null;
  let busy = false;

  function showError(message) {
    view.error = message;
    $("error").textContent = message;
    $("error").hidden = false;
  }

  async function refresh() {
    if (busy) return;
    busy = true;
    let data = null;
    try {
      const resp = await fetch("/swarm.json", { headers: Swarm.headers(), cache: "no-store" });
      if (!resp.ok) {
        showError(await Swarm.errorOf(resp));
        if (resp.status === 401) keybar.show(Swarm.apiKey() ? "this key was refused" : "this server needs a key");
        return;
      }
      data = await resp.json();
    } catch (e) {
      showError(`the server does not answer (${e.message})`);
      return;
    } finally {
      busy = false;
    }
    view.updated = Date.now();
    view.error = null;
    $("error").hidden = true;
    render(data); // a failure here is the page's own: window.swarmErrors has it
    view.data = data;
  }

  // The invite nodes join with (/swarm/invite: behind the API key, or this machine's browser only), read
  // once and again when a key is given; the section stays hidden where the server gives none.
  async function invite() {
    try {
      const resp = await fetch("/swarm/invite", { headers: Swarm.headers(), cache: "no-store" });
      if (!resp.ok) return;
      const d = await resp.json();
      $("invite-text").textContent = d.invite;
      if (d.qr) {
        $("invite-qr").src = d.qr;
        $("invite-qr").hidden = false;
      }
      $("invite").hidden = false;
    } catch (e) {
      // (no invite shown: the map itself says when the server does not answer)
    }
  }
  view.invite = invite;

  function render(d) {
    const s = d.server || {};
    $("model").textContent = s.model_id || d.model || "";
    document.title = `${s.model_id || "swarm"} · swarm map`;
    cards(d);
    nodes(d);
    coverage(d);
    routing(d);
    SwarmCharts.line($("chart-tps"), d.history.seconds_ago, d.history.tokens_per_second, { kind: "tps" });
    SwarmCharts.line($("chart-ttft"), d.history.seconds_ago, d.history.ttft_seconds,
      { kind: "ttft", joined: false, min: 0.1 });
    requests(d.requests || []);
    $("updated").textContent = `updated ${new Date(view.updated).toLocaleTimeString()}`;
  }

  function card(label, value, title) {
    const c = Swarm.el("div", { class: "card", title: title || "" });
    c.append(Swarm.el("div", { class: "value" }, value), Swarm.el("div", { class: "label" }, label));
    return c;
  }

  function cards(d) {
    const s = d.server || {};
    const up = d.nodes.filter((n) => n.state === "up").length;
    let cells = 0;
    let held = 0;
    for (const row of d.grid.holders) {
      for (const v of row) {
        if (v < 0) continue;
        cells++;
        if (v > 0) held++;
      }
    }
    const out = [];
    if (!s.in_process) out.push(card("nodes up", `${up} / ${d.nodes.length}`));
    out.push(card("slabs with a live holder", `${held} / ${cells}`));
    out.push(card("slots busy", `${s.active} / ${s.slots}`, `${s.queued} waiting; ${s.ctx_size} tokens each`));
    out.push(card("queued", `${s.queued}`));
    out.push(card("tokens/s", Swarm.num(s.tokens_per_second), "generated, over the last 10 s"));
    const c = s.checks;
    if (c) {
      out.push(card("audits / probes", `${c.audits} / ${c.probes}`,
        c.answers_checked ? "answers recomputed here / nodes probed before their first call" : "answers not checked"));
      out.push(card("nodes caught", `${c.banned}`));
      out.push(card("failovers / hedges", `${c.failovers} / ${c.hedges}`));
    }
    $("cards").replaceChildren(...out);
  }

  function answers(n) {
    if (n.banned_because) return `caught: ${n.banned_because}`;
    if (n.answers === "ok") return n.audits_passed === null ? "ok" : `ok (${n.audits_passed} audits)`;
    return n.answers === "-" ? "not checked" : n.answers;
  }

  function nodes(d) {
    const rows = d.nodes.map((n) => {
      const tr = Swarm.el("tr", { class: `node state-${n.state}`, "data-address": n.address });
      const state = Swarm.el("td", { class: "state" });
      state.append(Swarm.el("span", { class: "dot" }), document.createTextNode(
        n.state + (n.error && n.state === "down" ? ` (${n.error})` : "")));
      const who = Swarm.el("td", {}, n.address);
      if (n.name) who.append(Swarm.el("span", { class: "sub" }, n.name));
      const cls = n.numerics_class || "";
      const mem = Swarm.el("td", { title: `budget for exact copies: ${n.memory_budget_bytes ? Swarm.bytes(n.memory_budget_bytes) : "unlimited"}` },
        Swarm.bytes(n.held_bytes));
      if (n.cache_bytes) mem.append(Swarm.el("span", { class: "sub" }, `+ ${Swarm.bytes(n.cache_bytes)} copies`));
      const slabs = Swarm.el("td", { class: "slabs", title: n.held || "" }, n.slabs === null ? "–" : `${n.slabs}`);
      if (n.held) slabs.append(Swarm.el("span", { class: "sub" }, n.held.length > 48 ? n.held.slice(0, 45) + "…" : n.held));
      if (n.dropped_slabs) slabs.append(Swarm.el("span", { class: "sub warn" }, `dropped ${n.dropped_slabs}: ${n.dropped}`));
      const ms = !n.answering ? null : n.ms_per_call_recent !== null ? n.ms_per_call_recent : n.ms_per_call;
      tr.append(state, who, Swarm.el("td", { title: cls }, cls ? cls.split(" / ")[0] : "–"), mem, slabs,
        Swarm.el("td", { class: "num" }, Swarm.num(n.calls_per_second)),
        Swarm.el("td", { class: "num" }, Swarm.num(ms, 2)),
        Swarm.el("td", { class: n.banned_because ? "warn" : "" }, answers(n)));
      return tr;
    });
    $("nodes").tBodies[0].replaceChildren(...rows);
    const inProcess = d.server && d.server.in_process;
    $("nodes").hidden = !!inProcess;
    $("no-nodes").hidden = !inProcess;
  }

  function coverage(d) {
    const g = d.grid;
    const inProcess = d.server && d.server.in_process;
    if (!grid.holders) grid.holders = new SwarmCharts.Grid($("grid"));
    grid.holders.update(g.layers, g.experts, (r, e) => {
      const v = g.holders[r][e];
      const layer = g.layers[r];
      if (v < 0) return ["na", null, `layer ${layer} expert ${e}: not in this model`];
      if (inProcess) return ["hp", null, `layer ${layer} expert ${e}: in process`];
      const cls = v === 0 ? "h0" : v === 1 ? "h1" : "h2";
      return [cls, null, `layer ${layer} expert ${e}: ${v} live holder${v === 1 ? "" : "s"}`];
    });
    const missing = [];
    g.layers.forEach((layer, r) => {
      const none = [];
      g.holders[r].forEach((v, e) => {
        if (v === 0) none.push(e);
      });
      if (none.length) missing.push(`layer ${layer}: experts ${Swarm.ranges(none)}`);
    });
    const o = $("orphans");
    o.className = missing.length ? "orphans warn" : "orphans";
    o.textContent = missing.length
      ? `no live holder: ${missing.slice(0, 8).join("; ")}${missing.length > 8 ? `; and ${missing.length - 8} more layers` : ""}`
      : "every expert has a live holder";
  }

  function routing(d) {
    const r = d.routing;
    const note = $("routing-note");
    if (!r) {
      note.textContent = "not counted in process: start `swarm serve` with --stats FILE to count the router's picks";
      $("routing").replaceChildren();
      grid.routing = null;
      return;
    }
    note.textContent = r.source === "router"
      ? "how often the router picked each expert since the server started"
      : "rows each expert's holders computed (their own counts); darker is busier";
    let top = 0;
    for (const row of r.counts) for (const v of row) top = Math.max(top, v);
    if (!grid.routing) grid.routing = new SwarmCharts.Grid($("routing"));
    const g = d.grid;
    grid.routing.update(g.layers, g.experts, (i, e) => {
      const v = r.counts[i][e];
      if (v < 0) return ["na", null, ""];
      return ["heat", top ? 0.06 + (0.94 * v) / top : 0.06, `layer ${g.layers[i]} expert ${e}: ${v}`];
    });
  }

  function requests(list) {
    const rows = list.map((q) => {
      const tr = Swarm.el("tr", { class: `req ${q.state}` });
      const cells = [q.slot === null ? "–" : q.slot, q.state, q.prompt_tokens, q.cached_tokens, q.read_tokens,
        q.generated, q.max_tokens, Swarm.num(q.seconds), q.ttft_seconds === null ? "–" : Swarm.num(q.ttft_seconds, 2)];
      cells.forEach((c, i) => tr.append(Swarm.el("td", { class: i >= 2 ? "num" : "" }, `${c}`)));
      return tr;
    });
    $("requests").tBodies[0].replaceChildren(...rows);
    $("no-requests").hidden = list.length > 0;
  }

  document.addEventListener("DOMContentLoaded", () => {
    keybar = Swarm.keyBar(() => {
      refresh();
      invite();
    });
    refresh();
    invite();
    setInterval(refresh, REFRESH_MS);
  });
})();
