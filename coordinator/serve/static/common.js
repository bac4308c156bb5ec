// What both pages share: the API key (asked in the page, kept in this browser's localStorage only, sent as
// a Bearer token to this same server), fetching JSON with it, and number formats.
"use strict";

// The page's own failures, for a look from the console or a test: a script error, a promise nobody caught.
window.swarmErrors = [];
window.addEventListener("error", (e) => window.swarmErrors.push(String(e.message)));
window.addEventListener("unhandledrejection", (e) => window.swarmErrors.push(String(e.reason)));

const Swarm = (() => {
  const KEY = "swarm-api-key";

  function apiKey() {
    return localStorage.getItem(KEY) || "";
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }

  // An OpenAI error object's message, or the status line.
  async function errorOf(resp) {
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (_) {
      // not JSON: the status says it
    }
    return `${resp.status} ${resp.statusText}`;
  }

  // The key bar: shown when the server wants a key (a 401), hidden once a key works.
  function keyBar(onSaved) {
    const bar = document.getElementById("keybar");
    const input = document.getElementById("key");
    const note = document.getElementById("key-note");
    const show = (message) => {
      bar.hidden = false;
      note.textContent = message || "";
      input.value = apiKey();
      input.focus();
    };
    const save = () => {
      const v = input.value.trim();
      if (v) localStorage.setItem(KEY, v);
      else localStorage.removeItem(KEY);
      bar.hidden = true;
      onSaved();
    };
    document.getElementById("save-key").addEventListener("click", save);
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") save();
    });
    document.getElementById("forget-key").addEventListener("click", () => {
      localStorage.removeItem(KEY);
      input.value = "";
      onSaved();
    });
    return { show, hide: () => { bar.hidden = true; } };
  }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i++;
    }
    return i ? `${n.toFixed(n < 10 ? 1 : 0)} ${units[i]}` : `${n} B`;
  }

  function num(x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) return "–";
    return x.toFixed(digits === undefined ? 1 : digits);
  }

  // "0-3,8" from [0, 1, 2, 3, 8]
  function ranges(ids) {
    const out = [];
    let start = null;
    let prev = null;
    for (const i of ids) {
      if (start !== null && i === prev + 1) {
        prev = i;
        continue;
      }
      if (start !== null) out.push(start === prev ? `${start}` : `${start}-${prev}`);
      start = prev = i;
    }
    if (start !== null) out.push(start === prev ? `${start}` : `${start}-${prev}`);
    return out.join(",");
  }

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  return { apiKey, headers, errorOf, keyBar, bytes, num, ranges, el };
})();
