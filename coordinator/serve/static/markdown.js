// A small Markdown renderer for the model's answers. Safe by construction: every piece of the model's text
// is HTML-escaped before any markup of ours is added, and a link keeps only http(s), relative and #anchor
// targets. Handles what chat models write: fenced code, inline code, headings, lists, quotes, rules,
// tables, bold, italics, strike-through, links; a <think>...</think> section becomes a folded block, as does an
// answer's reasoning_content (renderAnswer), and its tool calls are shown by name with their arguments.
"use strict";

const SwarmMarkdown = (() => {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

  function escapeHtml(s) {
    return s.replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  function safeHref(url) {
    // `url` is escaped text already; decoding only &amp; lets a query string through
    const raw = url.replace(/&amp;/g, "&");
    if (/^(https?:\/\/|\/(?!\/)|#)/i.test(raw)) return url;
    return null;
  }

  // inline markup of one escaped line; code spans are cut out first so nothing inside them changes
  function inline(escaped) {
    const codes = [];
    let s = escaped.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, _ticks, code) => {
      codes.push(`<code>${code.trim()}</code>`);
      return `\u0000${codes.length - 1}\u0000`;
    });
    s = s.replace(/!?\[([^\]]*)\]\(([^)\s]+)\)/g, (whole, text, url) => {
      const href = safeHref(url);
      return href === null ? text : `<a href="${href}" target="_blank" rel="noopener noreferrer">${text}</a>`;
    });
    s = s.replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>");
    s = s.replace(/__(?=\S)([\s\S]*?\S)__/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*\w])\*(?=\S)([^*]*?\S)\*(?!\w)/g, "$1<em>$2</em>");
    s = s.replace(/(^|[^_\w])_(?=\S)([^_]*?\S)_(?!\w)/g, "$1<em>$2</em>");
    s = s.replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => codes[Number(i)]);
  }

  function codeBlock(lang, lines) {
    const cls = lang ? ` class="lang-${escapeHtml(lang.replace(/[^\w+-]/g, ""))}"` : "";
    return `<div class="code"><button type="button" class="copy" title="copy">copy</button>` +
      `<pre><code${cls}>${escapeHtml(lines.join("\n"))}</code></pre></div>`;
  }

  function tableRow(line, tag) {
    const cells = line.trim().replace(/^\||\|$/g, "").split("|");
    return "<tr>" + cells.map((c) => `<${tag}>${inline(escapeHtml(c.trim()))}</${tag}>`).join("") + "</tr>";
  }

  function blocks(src) {
    const lines = src.replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let para = [];
    let list = null; // {tag, items}
    const flushPara = () => {
      if (para.length) out.push(`<p>${para.map((l) => inline(escapeHtml(l))).join("<br>")}</p>`);
      para = [];
    };
    const flushList = () => {
      if (list) out.push(`<${list.tag}>${list.items.map((i) => `<li>${i}</li>`).join("")}</${list.tag}>`);
      list = null;
    };
    const flush = () => {
      flushPara();
      flushList();
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^\s*(```+|~~~+)\s*([^`\s]*)/);
      if (fence) {
        flush();
        const body = [];
        let j = i + 1;
        while (j < lines.length && !lines[j].trim().startsWith(fence[1])) body.push(lines[j++]);
        out.push(codeBlock(fence[2], body)); // an unclosed fence (still streaming) is code to the end
        i = j;
        continue;
      }
      if (!line.trim()) {
        flush();
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      if (heading) {
        flush();
        const n = heading[1].length;
        out.push(`<h${n}>${inline(escapeHtml(heading[2].replace(/\s#+\s*$/, "")))}</h${n}>`);
        continue;
      }
      if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) {
        flush();
        out.push("<hr>");
        continue;
      }
      if (/^\s*\|.*\|\s*$/.test(line) && i + 1 < lines.length && /^\s*\|?[\s:|-]+\|?\s*$/.test(lines[i + 1])
          && lines[i + 1].includes("-")) {
        flush();
        const rows = [tableRow(line, "th")];
        let j = i + 2;
        while (j < lines.length && /^\s*\|.*\|\s*$/.test(lines[j])) rows.push(tableRow(lines[j++], "td"));
        out.push(`<table>${rows.join("")}</table>`);
        i = j - 1;
        continue;
      }
      const quote = line.match(/^\s*>\s?(.*)$/);
      if (quote) {
        flush();
        const body = [quote[1]];
        while (i + 1 < lines.length && /^\s*>/.test(lines[i + 1])) body.push(lines[++i].replace(/^\s*>\s?/, ""));
        out.push(`<blockquote>${blocks(body.join("\n"))}</blockquote>`);
        continue;
      }
      const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
      if (item) {
        flushPara();
        const tag = /\d/.test(item[1]) ? "ol" : "ul";
        if (list && list.tag !== tag) flushList();
        if (!list) list = { tag, items: [] };
        list.items.push(inline(escapeHtml(item[2])));
        continue;
      }
      if (list && /^\s{2,}\S/.test(line)) {
        list.items[list.items.length - 1] += " " + inline(escapeHtml(line.trim()));
        continue;
      }
      flushList();
      para.push(line);
    }
    flush();
    return out.join("");
  }

  // Text -> HTML. A leading <think>...</think> (reasoning models) is folded away, open while it streams.
  function render(text) {
    text = text.replace(/\u0000/g, ""); // the code-span placeholders' mark
    const think = text.match(/^\s*<think>([\s\S]*?)(<\/think>|$)/);
    if (!think) return blocks(text);
    return folded(think[1], think[2] !== "</think>") + blocks(text.slice(think[0].length));
  }

  function folded(reasoning, open) {
    return `<details class="think"${open ? " open" : ""}><summary>${open ? "thinking…" : "thought"}</summary>` +
      `${blocks(reasoning)}</details>`;
  }

  // arguments as the API sends them (JSON text, perhaps still coming) laid out when they parse
  function prettyArguments(text) {
    try {
      return JSON.stringify(JSON.parse(text), null, 2);
    } catch (_) {
      return text;
    }
  }

  // An answer as the API gives it: {reasoning, text, calls: [{name, arguments}]}. The reasoning is folded (open
  // while it is all that has come), the text is Markdown, each call a block of its name and arguments.
  function renderAnswer(answer, streaming) {
    const calls = answer.calls || [];
    let html = "";
    if (answer.reasoning) html += folded(answer.reasoning, streaming && !answer.text && !calls.length);
    html += render(answer.text || "");
    for (const call of calls) {
      html += `<div class="call"><div class="call-name">called <code>${escapeHtml(call.name || "")}</code></div>` +
        `<pre><code>${escapeHtml(prettyArguments(call.arguments || ""))}</code></pre></div>`;
    }
    return html;
  }

  return { render, renderAnswer, escapeHtml };
})();
