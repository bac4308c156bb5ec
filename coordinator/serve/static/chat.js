// The chat page: the conversation kept here (and in sessionStorage, so a reload keeps it), sent whole on
// every turn (the server continues from the state its slot holds, so a long chat stays fast), the answer
// streamed from /v1/chat/completions as server-sent events and rendered as Markdown while it comes, its
// thinking (reasoning_content) folded and its tool calls shown. Stop aborts the request: the server sees its
// client go and frees the slot.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const STORE = "swarm-chat";
  // what scripts (and the browser tests) read: the conversation as sent, each answer with its figures
  const state = (window.swarmChat = { model: null, messages: [], answers: [], current: null, busy: false, error: null });
  let controller = null;
  let keybar = null;

  function showError(message) {
    state.error = message;
    $("error").textContent = message;
    $("error").hidden = false;
  }

  function hideError() {
    state.error = null;
    $("error").hidden = true;
  }

  // The model's id (/v1/models); false when the server does not answer or wants another key.
  async function loadModel() {
    let resp;
    try {
      resp = await fetch("/v1/models", { headers: Swarm.headers() });
    } catch (e) {
      showError(`the server does not answer (${e.message})`);
      return false;
    }
    if (!resp.ok) {
      const message = await Swarm.errorOf(resp);
      showError(message);
      if (resp.status === 401) keybar.show(Swarm.apiKey() ? "this key was refused" : "this server needs a key");
      return false;
    }
    const body = await resp.json();
    state.model = body.data[0].id;
    $("model").textContent = state.model;
    document.title = `${state.model} · swarm chat`;
    hideError();
    return true;
  }

  function messageView(role) {
    $("empty").hidden = true;
    const div = Swarm.el("div", { class: `msg ${role}` });
    div.append(Swarm.el("div", { class: "who" }, role === "user" ? "you" : state.model || "model"));
    const body = Swarm.el("div", { class: "body" });
    const meta = Swarm.el("div", { class: "meta" });
    div.append(body, meta);
    const log = $("log");
    const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
    log.append(div);
    if (atBottom) log.scrollTop = log.scrollHeight;
    return { div, body, meta };
  }

  // a user's text as typed; an answer ({text, reasoning, calls}) as Markdown, its thinking folded
  function showText(view, role, text, answer, streaming) {
    if (role === "user") view.body.textContent = text;
    else view.body.innerHTML = SwarmMarkdown.renderAnswer(answer || { text }, streaming);
  }

  // one chunk's delta into the answer: content, reasoning_content, and tool calls by their index (the name
  // and id come first, the arguments in pieces); whether it brought anything
  function take(answer, delta) {
    let got = false;
    if (delta.content) {
      answer.text += delta.content;
      got = true;
    }
    if (delta.reasoning_content) {
      answer.reasoning += delta.reasoning_content;
      got = true;
    }
    for (const piece of delta.tool_calls || []) {
      const call = (answer.calls[piece.index] ||= { id: null, name: "", arguments: "" });
      if (piece.id) call.id = piece.id;
      if (piece.function && piece.function.name) call.name += piece.function.name;
      if (piece.function && piece.function.arguments) call.arguments += piece.function.arguments;
      got = true;
    }
    return got;
  }

  function figures(answer) {
    const t = answer.timings;
    const parts = [];
    if (t) {
      const prompt = t.prompt_ms > 0 ? ` at ${Swarm.num((1000 * t.prompt_n) / t.prompt_ms)} tok/s` : "";
      const held = t.cache_n ? ` (+${t.cache_n} held)` : "";
      parts.push(`prompt ${t.prompt_n} tokens${held}${prompt}`);
      const decode = t.predicted_ms > 0 && t.predicted_n > 1
        ? ` at ${Swarm.num((1000 * (t.predicted_n - 1)) / t.predicted_ms)} tok/s` : "";
      parts.push(`answer ${t.predicted_n} tokens${decode}`);
    }
    if (answer.first !== null) parts.push(`first token ${Swarm.num(answer.first / 1000, 2)} s`);
    if (answer.stopped) parts.push("stopped");
    else if (answer.finish === "length") parts.push("max tokens reached");
    return parts.join(" · ");
  }

  // The server-sent events of a streamed answer, as parsed JSON objects, until [DONE].
  async function* events(stream) {
    const reader = stream.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const data = buf.slice(0, cut).split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trimStart()).join("\n");
        buf = buf.slice(cut + 2);
        if (!data) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }

  function setBusy(busy) {
    state.busy = busy;
    $("send").hidden = busy;
    $("stop").hidden = !busy;
  }

  function save() {
    try {
      sessionStorage.setItem(STORE, JSON.stringify({ messages: state.messages, answers: state.answers }));
    } catch (_) {
      // storage full or off: the page still holds the conversation
    }
  }

  function number(id, fallback) {
    const v = Number($(id).value);
    return Number.isFinite(v) ? v : fallback;
  }

  async function send(text) {
    hideError();
    setBusy(true);
    if (!state.model && !(await loadModel())) {
      setBusy(false);
      if (!$("prompt").value) $("prompt").value = text; // not sent: given back to send again
      return;
    }
    const userView = messageView("user");
    showText(userView, "user", text);
    const messages = state.messages.concat([{ role: "user", content: text }]);
    const view = messageView("assistant");
    view.div.classList.add("streaming");
    const answer = {
      text: "", reasoning: "", calls: [], pieces: 0, finish: null, timings: null, usage: null, first: null,
      stopped: false,
    };
    state.current = answer;
    const request = {
      model: state.model, messages, stream: true, stream_options: { include_usage: true },
      temperature: number("temperature", 0.7), max_tokens: Math.max(1, Math.round(number("max-tokens", 512))),
    };
    controller = new AbortController();
    const started = performance.now();
    let dirty = false;
    let done = false; // a paint still pending from the stream must not open the thinking again
    const paint = () => {
      dirty = false;
      showText(view, "assistant", answer.text, answer, !done);
      const log = $("log");
      if (log.scrollHeight - log.scrollTop - log.clientHeight < 160) log.scrollTop = log.scrollHeight;
    };
    let failed = null;
    try {
      const resp = await fetch("/v1/chat/completions", {
        method: "POST", headers: Swarm.headers({ "Content-Type": "application/json" }),
        body: JSON.stringify(request), signal: controller.signal,
      });
      if (!resp.ok) {
        failed = await Swarm.errorOf(resp);
        if (resp.status === 401) keybar.show("this key was refused");
      } else {
        for await (const ev of events(resp.body)) {
          if (ev.error) throw new Error(ev.error.message);
          const choice = ev.choices && ev.choices[0];
          if (choice && choice.delta && take(answer, choice.delta)) {
            if (answer.first === null) answer.first = performance.now() - started;
            answer.pieces++;
            if (!dirty) {
              dirty = true;
              setTimeout(paint, 30);
            }
          }
          if (choice && choice.finish_reason) answer.finish = choice.finish_reason;
          if (ev.timings) answer.timings = ev.timings;
          if (ev.usage) answer.usage = ev.usage;
        }
      }
    } catch (e) {
      if (e.name === "AbortError") answer.stopped = true;
      else failed = e.message;
    } finally {
      controller = null;
      state.current = null;
      setBusy(false);
      view.div.classList.remove("streaming");
    }
    if (failed !== null && !answer.pieces) {
      userView.div.remove(); // nothing came: give the message back to edit or send again
      view.div.remove();
      if (!$("prompt").value) $("prompt").value = text;
      $("empty").hidden = state.messages.length > 0;
      showError(failed);
      return;
    }
    if (failed !== null) showError(failed);
    done = true;
    paint();
    view.meta.textContent = figures(answer);
    state.messages = messages.concat([{ role: "assistant", content: answer.text }]);
    state.answers.push(answer);
    save();
  }

  function restore() {
    let saved = null;
    try {
      saved = JSON.parse(sessionStorage.getItem(STORE) || "null");
    } catch (_) {
      saved = null;
    }
    if (!saved || !Array.isArray(saved.messages)) return;
    state.messages = saved.messages;
    state.answers = saved.answers || [];
    let a = 0;
    for (const m of state.messages) {
      const view = messageView(m.role);
      const answer = m.role === "assistant" ? state.answers[a++] : null;
      showText(view, m.role, m.content, answer && answer.text === m.content ? answer : null, false);
      if (answer) view.meta.textContent = figures(answer);
    }
  }

  function newChat() {
    if (controller) controller.abort();
    state.messages = [];
    state.answers = [];
    sessionStorage.removeItem(STORE);
    for (const m of document.querySelectorAll("#log .msg")) m.remove();
    $("empty").hidden = false;
    hideError();
    $("prompt").focus();
  }

  function submit(e) {
    if (e) e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.busy) return;
    $("prompt").value = "";
    send(text);
  }

  document.addEventListener("DOMContentLoaded", () => {
    keybar = Swarm.keyBar(() => {
      state.model = null;
      loadModel();
    });
    $("form").addEventListener("submit", submit);
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) submit(e);
    });
    $("stop").addEventListener("click", () => {
      if (controller) controller.abort();
    });
    $("new-chat").addEventListener("click", newChat);
    $("key-button").addEventListener("click", () => keybar.show(""));
    $("log").addEventListener("click", (e) => {
      const button = e.target.closest(".copy");
      if (!button || !navigator.clipboard) return;
      navigator.clipboard.writeText(button.parentElement.querySelector("code").textContent).then(
        () => { button.textContent = "copied"; },
        () => { button.textContent = "copy failed"; },
      );
    });
    restore();
    loadModel();
    $("prompt").focus();
  });
})();
