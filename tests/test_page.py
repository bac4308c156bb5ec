"""`swarm serve`'s pages in a real headless Chromium (tests/browser.py): the chat at / against real servers
(in process and over two real nodes), and the swarm's map at /swarm over three real nodes, one of them
SIGKILLed while the page watches. The screenshots in docs/ are the ones these tests take
(SWARM_UPDATE_SCREENSHOTS=1 writes them there; otherwise to a temporary folder)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from browser import chromium, page_state, screenshot, wait_for
from conftest import FIXTURES
from selenium.webdriver.common.by import By

from swarm.coordinator.cli import main
from swarm.coordinator.cli.launch import spawn_server
from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.node.auth import KEY_ENV, SwarmKey, generate_key_text
from swarm.node.invite import cert_pin, parse_invite
from swarm.sharding.identity import identity_of
from swarm.sharding.manifest import read_manifest
from swarm.sharding.ranges import format_slabs
from swarm.sharding.shard import shard_model

MODEL = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"
MODEL_ID = "model-q4_k_m"
KEY = "page-test-key"
ANSWER_SECONDS = 180  # one answer of a few dozen tokens, on a machine busy with other tests

pytestmark = pytest.mark.slow


class Server:
    def __init__(self, tmp: Path, *args: str, source: Path = MODEL) -> None:
        self.proc = spawn_server(source, list(args), tmp).wait_ready(180)
        self.url = self.proc.ready["url"]
        self.base = self.url[: -len("/v1")]

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=ANSWER_SECONDS)

    def get(self, path: str, key: str | None = KEY) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(
                urllib.request.Request(self.base + path, headers=headers), timeout=30
            ) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self) -> int:
        return self.proc.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    d = chromium(tmp_path_factory.mktemp("chromium"))
    yield d
    d.quit()


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory):
    s = Server(tmp_path_factory.mktemp("serve"), "--local", "--parallel", "1", "--ctx-size", "8192",
               "--api-key", KEY)  # fmt: skip
    yield s
    assert s.stop() == 0, s.proc.log_tail()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the screenshots go: the README's own (docs/) only when asked, so that a test run leaves the tree
    as it was; else pytest's temporary directory, which pytest itself prunes."""
    if os.environ.get("SWARM_UPDATE_SCREENSHOTS") == "1":
        return Path(__file__).resolve().parent.parent / "docs"
    return tmp_path_factory.mktemp("screenshots")


def open_page(d: Any, server: Server, path: str, key: str | None) -> None:
    """The page with `key` in this origin's localStorage (as the page keeps what the user typed)."""
    d.get(server.base + path)
    d.execute_script(
        "arguments[0] === null ? localStorage.clear() : localStorage.setItem('swarm-api-key', arguments[0]);"
        "sessionStorage.clear();",
        key,
    )
    d.get(server.base + path)


def ask(d: Any, text: str, max_tokens: int, wait: bool = True) -> dict[str, Any] | None:
    """Type `text` into the chat with temperature 0 and `max_tokens`, send it; its answer once it ends."""
    before = len(page_state(d, "swarmChat")["answers"])
    d.execute_script(
        "document.getElementById('temperature').value = '0';"
        "document.getElementById('max-tokens').value = String(arguments[0]);",
        max_tokens,
    )
    d.find_element(By.ID, "prompt").send_keys(text)
    d.find_element(By.ID, "send").click()
    if not wait:
        return None
    state = wait_for(
        lambda: (s := page_state(d, "swarmChat")) and len(s["answers"]) > before and s,
        ANSWER_SECONDS,
        lambda: f"no answer in the page: {page_state(d, 'swarmChat')}",
    )
    return state["answers"][-1]


def api_answer(server: Server, messages: list[dict[str, str]], max_tokens: int, key: str = KEY) -> Any:
    return server.client(key).chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,  # type: ignore[arg-type]
    )


def test_the_chat_streams_the_apis_answer_and_keeps_the_conversation(
    local: Server, browser: Any, shots: Path
) -> None:
    d = browser
    open_page(d, local, "/", KEY)
    wait_for(lambda: d.find_element(By.ID, "model").text == MODEL_ID, 60, "the page did not show the model")
    first = ask(d, "Name three fruits.", 32)
    assert first is not None and not first["stopped"]
    u1 = {"role": "user", "content": "Name three fruits."}
    api = api_answer(local, [u1], 32)
    assert first["text"] == api.choices[0].message.content
    # the template opens <think>: the random model's answer is thinking, shown folded
    assert first["reasoning"] == api.choices[0].message.model_extra["reasoning_content"] != ""
    assert first["pieces"] > 1  # streamed as it came, not at once
    assert first["timings"]["predicted_n"] == api.usage.completion_tokens
    thought = d.find_elements(By.CSS_SELECTOR, ".msg.assistant details.think")[-1]
    assert thought.get_attribute("open") is None and thought.text.strip() == "thought"
    assert first["reasoning"].split()[0] in thought.get_attribute("textContent")
    assert "tok/s" in d.find_elements(By.CSS_SELECTOR, ".msg.assistant .meta")[-1].text

    second = ask(d, "And two vegetables?", 24)  # the whole conversation again, continued from held state
    assert second is not None
    a1 = {"role": "assistant", "content": first["text"]}
    u2 = {"role": "user", "content": "And two vegetables?"}
    assert page_state(d, "swarmChat")["messages"][:3] == [u1, a1, u2]
    again = api_answer(local, [u1, a1, u2], 24).choices[0].message
    assert (second["text"], second["reasoning"]) == (again.content, again.model_extra["reasoning_content"])
    assert second["timings"]["cache_n"] > 0
    _no_script_errors(d)
    d.save_screenshot(str(shots / "page-chat.png"))


def test_stop_mid_answer_frees_the_slot(local: Server, browser: Any) -> None:
    d = browser
    open_page(d, local, "/", KEY)
    wait_for(lambda: d.find_element(By.ID, "model").text == MODEL_ID, 60, "the page did not show the model")
    ask(d, "Count from one to a million.", 8000, wait=False)
    wait_for(lambda: (page_state(d, "swarmChat")["current"] or {}).get("pieces", 0) >= 3, ANSWER_SECONDS,
             "the answer did not start streaming")  # fmt: skip
    d.find_element(By.ID, "stop").click()
    answer = wait_for(lambda: page_state(d, "swarmChat")["answers"], 10, "stop did not end the answer")[-1]
    assert answer["stopped"] and answer["timings"] is None
    # --parallel 1 and minutes of tokens left to decode: /health says the slot is busy until it is freed
    wait_for(lambda: local.get("/health")[1]["active"] == 0, 10, "the slot was not freed within 10 s")
    started = time.monotonic()
    assert api_answer(local, [{"role": "user", "content": "Hi"}], 4).choices[0].message.content is not None
    assert time.monotonic() - started < 60
    assert d.find_element(By.ID, "send").is_displayed() and "stopped" in d.find_elements(
        By.CSS_SELECTOR, ".msg.assistant .meta")[-1].text  # fmt: skip


def test_a_wrong_api_key_shows_an_error_in_the_page(local: Server, browser: Any) -> None:
    d = browser
    open_page(d, local, "/", "not-the-key")
    error = d.find_element(By.ID, "error")
    wait_for(lambda: error.is_displayed() and "API key" in error.text, 30, "no error for a wrong key")
    assert d.find_element(By.ID, "keybar").is_displayed()
    d.find_element(By.ID, "prompt").send_keys("Hello")
    d.find_element(By.ID, "send").click()
    wait_for(lambda: not page_state(d, "swarmChat")["busy"], 30, "the refused request did not end")
    assert error.is_displayed() and "API key" in error.text
    assert not d.find_elements(By.CSS_SELECTOR, ".msg")  # nothing was answered
    assert d.find_element(By.ID, "prompt").get_attribute("value") == "Hello"  # given back to send again
    d.find_element(By.ID, "prompt").clear()

    key = d.find_element(By.ID, "key")
    key.clear()
    key.send_keys(KEY)
    d.find_element(By.ID, "save-key").click()
    wait_for(lambda: d.find_element(By.ID, "model").text == MODEL_ID, 30, "the right key was not taken")
    assert not error.is_displayed() and not d.find_element(By.ID, "keybar").is_displayed()

    open_page(d, local, "/swarm", "not-the-key")  # the map's data is behind the key too
    wait_for(lambda: "API key" in d.find_element(By.ID, "error").text, 30, "no error on /swarm")
    open_page(d, local, "/swarm", KEY)
    wait_for(lambda: (page_state(d, "swarmMap") or {}).get("data"), 30, "the map did not load")
    assert d.find_element(By.ID, "no-nodes").is_displayed()  # in process: no nodes, every slab here
    assert len(d.find_elements(By.CSS_SELECTOR, "#grid rect.hp")) == 4 * 8  # every slab in process
    _no_script_errors(d)


def test_the_markdown_renderer_escapes_the_models_html(local: Server, browser: Any) -> None:
    d = browser
    open_page(d, local, "/", KEY)
    text = (
        "# Title\n<img src=x onerror=alert(1)> **bold** `<i>code</i>` [safe](https://example.org/?a=1&b=2) "
        "[bad](javascript:alert(1))\n\n```python\n<script>alert(1)</script>\n```\n- one\n- two"
    )
    html = d.execute_script("return SwarmMarkdown.render(arguments[0])", text)
    assert "<img" not in html and "<script" not in html and "javascript:" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html and "<strong>bold</strong>" in html
    assert "<code>&lt;i&gt;code&lt;/i&gt;</code>" in html and "<h1>Title</h1>" in html
    assert '<a href="https://example.org/?a=1&amp;b=2"' in html and "<li>one</li><li>two</li>" in html
    assert '<code class="lang-python">&lt;script&gt;alert(1)&lt;/script&gt;</code>' in html


def test_an_answer_shows_its_thinking_folded_and_its_tool_calls(local: Server, browser: Any) -> None:
    d = browser
    open_page(d, local, "/", KEY)
    answer = {
        "reasoning": "The user <b>wants</b> weather.",
        "text": "Looking it up.",
        "calls": [{"name": "get_<weather>", "arguments": '{"city": "Paris", "days": 2}'}],
    }
    html = d.execute_script("return SwarmMarkdown.renderAnswer(arguments[0], false)", answer)
    assert html.startswith('<details class="think"><summary>thought</summary>')  # folded once done
    assert "The user &lt;b&gt;wants&lt;/b&gt; weather." in html and "<p>Looking it up.</p>" in html
    assert "called <code>get_&lt;weather&gt;</code>" in html
    assert "{\n  &quot;city&quot;: &quot;Paris&quot;,\n  &quot;days&quot;: 2\n}" in html  # laid out
    # while only thinking has come it is open; arguments still coming are shown as they are
    streaming = d.execute_script(
        "return SwarmMarkdown.renderAnswer(arguments[0], true)", {"reasoning": "Hmm", "text": "", "calls": []}
    )
    assert streaming.startswith('<details class="think" open><summary>thinking…</summary>')
    partial = d.execute_script(
        "return SwarmMarkdown.renderAnswer(arguments[0], true)",
        {"reasoning": "", "text": "", "calls": [{"name": "f", "arguments": '{"a": '}]},
    )
    assert "<code>{&quot;a&quot;: </code>" in partial and "details" not in partial


def test_the_chat_over_two_nodes_streams_the_apis_answer(tmp_path: Path, browser: Any) -> None:
    shard = tmp_path / "m.swarm"
    shard_model(MODEL, shard)
    nodes = start_nodes([(shard, ["--experts", "0-3"]), (shard, ["--experts", "4-7"])], tmp_path / "nodes")
    try:
        peers = [a for n in nodes for a in ("--peer", n.address)]
        s = Server(tmp_path, "--no-mdns", *peers, "--parallel", "1", "--model-id", MODEL_ID, source=shard)
        try:
            d = browser
            open_page(d, s, "/", None)
            wait_for(lambda: d.find_element(By.ID, "model").text == MODEL_ID, 60, "no model shown")
            answer = ask(d, "What is a mixture of experts?", 32)
            assert answer is not None and answer["pieces"] > 1
            api = api_answer(s, [{"role": "user", "content": "What is a mixture of experts?"}], 32, key="-")
            assert answer["text"] == api.choices[0].message.content
            assert answer["reasoning"] == api.choices[0].message.model_extra["reasoning_content"]
            _no_script_errors(d)
        finally:
            assert s.stop() == 0
    finally:
        stop_nodes(nodes)


def test_the_swarm_map_shows_every_node_and_a_killed_one_turns_red(
    tmp_path: Path, browser: Any, capsys: pytest.CaptureFixture[str], shots: Path
) -> None:
    shard = tmp_path / "m.swarm"
    shard_model(MODEL, shard)
    layers = read_manifest(shard).moe_layers
    ranges = [range(0, 4), range(2, 6), range(6, 8)]  # experts 2-3 with two holders; 6-7 on the last alone
    nodes = start_nodes([(shard, ["--experts", f"{r[0]}-{r[-1]}"]) for r in ranges], tmp_path / "nodes")
    try:
        peers = [a for n in nodes for a in ("--peer", n.address)]
        s = Server(tmp_path, "--no-mdns", *peers, "--parallel", "2", "--model-id", MODEL_ID, source=shard)
        try:
            for prompt in ("The list", "A mixture of experts"):  # traffic for the charts and routing counts
                s.client("-").completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, temperature=0)
            d = browser
            open_page(d, s, "/swarm", None)
            row_of = {n.address: f"tr.node[data-address='{n.address}']" for n in nodes}
            wait_for(lambda: all(_state(d, row_of[n.address]) == "up" for n in nodes), 30,
                     lambda: f"not every node shown up: {page_state(d, 'swarmMap')}")  # fmt: skip
            for n, r in zip(nodes, ranges, strict=True):
                slabs = d.find_element(By.CSS_SELECTOR, f"{row_of[n.address]} td.slabs").text.split("\n")
                assert slabs == [str(len(layers) * len(r)), format_slabs((la, e) for la in layers for e in r)]
            assert _cells(d, "h2") == [(la, e) for la in layers for e in (2, 3)]
            assert _cells(d, "h0") == []
            wait_for(lambda: d.find_elements(By.CSS_SELECTOR, "#routing rect.heat"), 30,
                     "no routing load drawn")  # the nodes' own counts  # fmt: skip
            assert max(page_state(d, "swarmMap")["data"]["history"]["tokens_per_second"]) > 0
            assert d.find_elements(By.CSS_SELECTOR, "#chart-tps path.stroke")
            _same_structure_as_status(s, shard, peers, capsys)

            nodes[2].process.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            wait_for(
                lambda: _state(d, row_of[nodes[2].address]) == "down", 30, "the killed node never turned red"
            )
            seconds = time.monotonic() - killed
            assert seconds <= 5, f"the killed node turned red after {seconds:.1f} s"
            dot = d.find_element(By.CSS_SELECTOR, f"{row_of[nodes[2].address]} .dot")
            assert dot.value_of_css_property("background-color") == "rgba(217, 48, 37, 1)"  # red
            wait_for(lambda: _cells(d, "h0") == [(la, e) for la in layers for e in (6, 7)], 10,
                     lambda: f"the grid shows no holder for {_cells(d, 'h0')}")  # fmt: skip
            assert "experts 6-7" in d.find_element(By.ID, "orphans").text
            assert all(_state(d, row_of[n.address]) == "up" for n in nodes[:2])
            _no_script_errors(d)
            screenshot(d, shots / "page-swarm.png")
        finally:
            assert s.stop() == 0
    finally:
        stop_nodes(nodes)


def test_the_map_shows_the_invite_nodes_join_with(tmp_path: Path, browser: Any) -> None:
    """A coordinator that takes joining nodes (--listen) shows `swarm invite`'s invite on its map, text and QR
    code, to a browser on its own machine (it has no --api-key): the invite is of this swarm's key, this model
    and the listener's address."""
    import socket

    shard = tmp_path / "m.swarm"
    shard_model(MODEL, shard)
    key_text = generate_key_text()
    key_file = tmp_path / "swarm.key"
    key_file.write_text(key_text)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = start_nodes([(shard, ["--no-mdns"])], tmp_path / "nodes", env={KEY_ENV: key_text})
    try:
        s = Server(tmp_path, "--no-mdns", "--peer", nodes[0].address, "--listen", f"127.0.0.1:{port}",
                   "--key-file", str(key_file), source=shard)  # fmt: skip
        try:
            status, body = s.get("/swarm/invite", key=None)
            assert status == 200, body
            invite = parse_invite(body["invite"])
            assert invite.addresses == (f"127.0.0.1:{port}",) and invite.matches(identity_of(shard))
            assert invite.pin == cert_pin(SwarmKey.from_text(key_text))
            assert body["qr"].startswith("data:image/svg+xml;base64,")
            d = browser
            open_page(d, s, "/swarm", None)
            wait_for(lambda: d.find_element(By.ID, "invite").is_displayed(), 30, "the map shows no invite")
            d.find_element(By.CSS_SELECTOR, "#invite summary").click()
            assert d.find_element(By.ID, "invite-text").text == body["invite"]
            wait_for(lambda: d.execute_script("return document.getElementById('invite-qr').naturalWidth") > 0,
                     10, "the invite's QR code is not drawn")  # fmt: skip
            _no_script_errors(d)
        finally:
            assert s.stop() == 0
    finally:
        stop_nodes(nodes)


def test_the_invite_is_behind_the_api_key_or_for_this_machine_only(local: Server) -> None:
    """Who may read the invite (it lets its holder join and fetch the experts): with an API key, a request that
    carries it; without one, this machine's browser only; a server that takes no joining nodes has none."""
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from swarm.coordinator.serve.api_error import ApiError
    from swarm.coordinator.serve.page import page_routes

    status, body = local.get("/swarm/invite")  # (the module's server: --local, no --listen)
    assert status == 404 and "--listen" in body["error"]["message"]

    def check_key(request: Any) -> None:
        if request.headers.get("authorization") != "Bearer k":
            raise ApiError(401, "missing or wrong API key")

    for keyed, headers, expect in ((True, {}, 401), (True, {"Authorization": "Bearer k"}, 200), (False, {}, 403)):
        app = Starlette(routes=page_routes(None, check_key, "swarm-invite-v1:x", keyed))  # type: ignore[arg-type]
        with TestClient(app) as client:  # (its requests come from "testclient", not a loopback address)
            r = client.get("/swarm/invite", headers=headers)
        assert r.status_code == expect, r.text
        if expect == 403:
            assert "--api-key" in r.json()["error"]["message"]


def _no_script_errors(d: Any) -> None:
    assert d.execute_script("return window.swarmErrors") == []


def _state(d: Any, row: str) -> str | None:
    found = d.find_elements(By.CSS_SELECTOR, row)
    if not found:
        return None
    classes = found[0].get_attribute("class").split()
    return next((c.removeprefix("state-") for c in classes if c.startswith("state-")), None)


def _cells(d: Any, cls: str) -> list[tuple[int, int]]:
    """The (layer, expert) cells of the coverage grid drawn as `cls` (h0: no live holder, h1: one, h2: 2+)."""
    cells = d.execute_script(
        "return [...document.querySelectorAll('#grid rect.' + arguments[0])]"
        ".map(r => [Number(r.dataset.layer), Number(r.dataset.expert)])",
        cls,
    )
    return sorted((la, e) for la, e in cells)


def _same_structure_as_status(
    s: Server, shard: Path, peers: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`swarm status --json` and /swarm.json give one structure: the same node records and coverage."""
    page = wait_for(lambda: (p := s.get("/swarm.json", key=None)[1]) and all(n["answering"] for n in p["nodes"])
                    and p, 30, "the server has not read every node's Info")  # fmt: skip
    capsys.readouterr()
    assert main(["status", str(shard), "--no-mdns", "--no-probe", "--json", *peers]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert {"model", "nodes", "coverage", "grid", "routing"} <= set(cli) <= set(page)
    cli_nodes, page_nodes = (sorted(r["nodes"], key=lambda n: n["address"]) for r in (cli, page))
    assert [set(n) for n in cli_nodes] == [set(n) for n in page_nodes]
    assert cli["coverage"] == page["coverage"] and cli["grid"] == page["grid"]
    for theirs, ours in zip(cli_nodes, page_nodes, strict=True):
        for k in ("address", "held", "slabs", "held_bytes", "numerics_class", "fingerprint", "state"):
            assert theirs[k] == ours[k], k
