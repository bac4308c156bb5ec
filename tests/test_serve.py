"""`swarm serve`: a real server process driven by the official `openai` client (and raw HTTP for what the
client cannot send), in process (--local) and over real node processes."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import FIXTURES

from swarm.coordinator.cli.launch import spawn_server
from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.sharding.shard import shard_model

MODEL = (
    FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"
)  # hybrid (DeltaNet + attention), real chat template
MODEL_ID = "model-q4_k_m"
KEY = "test-api-key"

pytestmark = pytest.mark.slow


class Server:
    def __init__(self, tmp: Path, *args: str, source: Path = MODEL, name: str = "serve") -> None:
        self.proc = spawn_server(source, list(args), tmp, name).wait_ready(120)
        self.url = self.proc.ready["url"]
        self.base = self.url[: -len("/v1")]

    def client(self, key: str = KEY, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, **kw)  # type: ignore[arg-type]

    def raw(self, path: str, body: bytes | None, key: str | None = KEY) -> tuple[int, dict, Any]:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(
            self.base + path, data=body, headers=headers, method="POST" if body else "GET"
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read()), r.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers

    def stop(self) -> int:
        return self.proc.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = Server(
        tmp_path_factory.mktemp("serve"), "--local", "--parallel", "8", "--ctx-size", "2048", "--api-key", KEY
    )
    yield s
    assert s.stop() == 0, s.proc.log_tail()


PROMPTS = [f"def function_{i}(value): return value" + " +" * i for i in range(8)]


def complete(c: openai.OpenAI, prompt: str, **kw: object) -> str:
    r = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=kw.pop("max_tokens", 24), **kw)  # type: ignore[arg-type]
    return r.choices[0].text


def test_models_chat_completion_and_streaming(server: Server) -> None:
    c = server.client()
    assert [m.id for m in c.models.list()] == [MODEL_ID]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    r = c.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20, temperature=0)  # type: ignore[arg-type]
    # the template opens <think>: the random model's answer is all thinking, in reasoning_content
    message = r.choices[0].message
    text = message.model_extra["reasoning_content"]
    assert message.content == "" and r.choices[0].finish_reason == "length" and r.usage is not None
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == 35  # the fixture's chat prompt
    assert text

    stream = c.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=20, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    deltas = "".join(
        (ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in chunks if ch.choices
    )
    assert deltas == text and not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20

    plain = complete(c, "The list", temperature=0)
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=MODEL_ID, prompt="The list", max_tokens=24, temperature=0, stream=True
        )
    )
    assert plain and streamed == plain


def test_stop_strings_cut_the_text(server: Server) -> None:
    c = server.client()
    full = complete(c, "The list", temperature=0, max_tokens=32)
    stop = full[5:8]
    assert stop and stop in full
    cut = c.completions.create(model=MODEL_ID, prompt="The list", max_tokens=32, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=MODEL_ID, prompt="The list", max_tokens=32, temperature=0, stop=stop, stream=True
        )
    )
    assert streamed == cut.choices[0].text


def test_eight_at_once_each_get_their_text_alone(server: Server) -> None:
    c = server.client()
    alone = [complete(c, p, temperature=0) for p in PROMPTS]
    sampled_alone = [complete(c, p, temperature=0.9, top_p=0.95, seed=7 + i) for i, p in enumerate(PROMPTS)]
    for n in (2, 4, 8):
        with cf.ThreadPoolExecutor(n) as ex:
            together = list(ex.map(lambda p: complete(c, p, temperature=0), PROMPTS))
        assert together == alone, f"{n} at once"
    with cf.ThreadPoolExecutor(8) as ex:
        sampled = list(
            ex.map(
                lambda ip: complete(c, ip[1], temperature=0.9, top_p=0.95, seed=7 + ip[0]), enumerate(PROMPTS)
            )
        )
    assert sampled == sampled_alone


def test_four_conversations_get_the_same_text_without_drafts(server: Server, tmp_path: Path) -> None:
    """The default server checks prompt-lookup drafts in its passes; one started with `--draft none` decodes
    one token a pass: four conversations at once, greedy and seeded, get the same text from both."""
    plain = Server(
        tmp_path, "--local", "--parallel", "4", "--ctx-size", "2048", "--api-key", KEY, "--draft", "none"
    )
    try:
        prompts = [p * 3 for p in PROMPTS[:4]]  # text that repeats: the lookup has somewhere to look
        for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 5}):
            got = []
            for s in (server, plain):
                c = s.client()
                with cf.ThreadPoolExecutor(4) as ex:
                    got.append(
                        list(ex.map(lambda p, c=c, kw=kw: complete(c, p, max_tokens=32, **kw), prompts))
                    )
            assert got[0] == got[1], kw
    finally:
        assert plain.stop() == 0, plain.proc.log_tail()


def test_a_long_prompt_is_read_beside_decoding_requests(server: Server) -> None:
    c = server.client()
    long_prompt = " ".join(f"item{i}" for i in range(150))  # several chunks
    alone_long = complete(c, long_prompt, temperature=0)
    alone = [complete(c, p, temperature=0, max_tokens=64) for p in PROMPTS[:3]]
    with cf.ThreadPoolExecutor(4) as ex:
        short = [ex.submit(complete, c, p, temperature=0, max_tokens=64) for p in PROMPTS[:3]]
        time.sleep(0.3)  # they are decoding when the long prompt arrives
        long_text = ex.submit(complete, c, long_prompt, temperature=0).result()
        assert [f.result() for f in short] == alone
    assert long_text == alone_long


def test_a_resent_conversation_continues_from_its_held_state(server: Server) -> None:
    c = server.client()
    history = [{"role": "user", "content": " ".join(f"word{i}" for i in range(200))}]
    first = c.chat.completions.create(model=MODEL_ID, messages=history, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    again = c.chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=history, max_tokens=12, temperature=0
    )  # type: ignore[arg-type]
    body = json.loads(again.text)
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    # every token before the first answer's generation prompt: the checkpoint at the end of the user's turn
    # (the template's generation prompt, <|im_start|>assistant\n<think>\n\n</think>\n\n, is 7 tokens)
    assert cached >= first.usage.prompt_tokens - 7

    # the same conversation read afresh (a server that holds nothing) gives the same text
    fresh = Server(
        Path(server.proc.log_file).parent / "fresh", "--local", "--parallel", "1", "--api-key", KEY
    )
    try:
        cold = json.loads(
            fresh.client()
            .chat.completions.with_raw_response.create(
                model=MODEL_ID,
                messages=history,
                max_tokens=12,
                temperature=0,  # type: ignore[arg-type]
            )
            .text
        )
    finally:
        assert fresh.stop() == 0
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the whole message: the template opens <think>, so the random model's answer is reasoning_content
    assert body["choices"][0]["message"] == cold["choices"][0]["message"]
    assert body["choices"][0]["message"]["reasoning_content"]
    assert body["timings"]["prompt_n"] < cold["timings"]["prompt_n"] / 3
    assert body["timings"]["prompt_ms"] < cold["timings"]["prompt_ms"]


def test_a_completion_sent_again_with_a_new_ending_continues_from_its_tail_checkpoint(server: Server) -> None:
    c = server.client()
    first = [300 + 7 * i for i in range(40)]
    c.completions.create(model=MODEL_ID, prompt=first, max_tokens=6, temperature=0)
    again = first[:-2] + [11, 12]  # the same prompt, its last two tokens changed
    raw = c.completions.with_raw_response.create(model=MODEL_ID, prompt=again, max_tokens=6, temperature=0)
    # the slot kept a checkpoint 4 tokens before the first prompt's end: only those are read again
    assert json.loads(raw.text)["usage"]["prompt_tokens_details"]["cached_tokens"] == len(first) - 4


def test_errors_are_openai_error_objects(server: Server) -> None:
    status, body, _ = server.raw("/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body, _ = server.raw("/v1/chat/completions", json.dumps({"model": MODEL_ID}).encode())
    assert status == 400 and "messages" in body["error"]["message"]
    status, body, _ = server.raw("/v1/completions", json.dumps({"prompt": "x"}).encode())
    assert status == 400 and body["error"]["param"] == "model"
    for bad in ({"prompt": "x", "stream_options": "yes"}, {"prompt": "x", "max_tokens": -1}, {"prompt": [1, "a"]},
                {"prompt": "x", "temperature": "hot"}, {"prompt": "x", "stop": [1]}, {"prompt": "x", "n": 2}):  # fmt: skip
        status, body, _ = server.raw("/v1/completions", json.dumps({"model": MODEL_ID, **bad}).encode())
        assert status == 400 and body["error"]["type"] == "invalid_request_error", (bad, body)
    status, body, _ = server.raw(
        "/v1/chat/completions", json.dumps({"model": MODEL_ID, "messages": [1]}).encode()
    )
    assert status == 400 and body["error"]["param"] == "messages"

    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    status, body, _ = server.raw("/v1/models", None, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"

    with pytest.raises(openai.NotFoundError) as e:
        server.client().completions.create(model="gpt-4", prompt="x")
    assert MODEL_ID in str(e.value)

    long = " ".join(f"w{i}" for i in range(1500))
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL_ID, prompt=long)
    msg = str(e.value)
    assert "2048" in msg and "tokens" in msg
    n = int(msg.split("has ")[1].split(" tokens")[0])
    assert n > 2048

    status, body, _ = server.raw("/health", None)
    assert status == 200 and body["status"] == "ok"


def test_metrics_in_prometheus_format(server: Server) -> None:
    complete(server.client(), "The list", temperature=0, max_tokens=4)
    with urllib.request.urlopen(server.base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "swarm_serve_requests",
        "swarm_serve_prompt_tokens",
        "swarm_serve_generated_tokens",
        "swarm_serve_time_to_first_token_seconds",
        "swarm_serve_queue_depth",
        "swarm_serve_tokens_per_second",
        "swarm_serve_draft_drafted",
        "swarm_serve_draft_accepted",
        "swarm_serve_draft_accept_rate",
        "swarm_serve_tokens_per_pass",
    ):
        assert name in families, name
    out = [s.value for s in families["swarm_serve_generated_tokens"].samples if s.name.endswith("_total")]
    assert out and out[0] >= 4


def test_a_full_queue_gets_429_with_retry_after(tmp_path: Path) -> None:
    s = Server(tmp_path, "--local", "--parallel", "1", "--max-queue", "1")
    try:
        c = s.client()
        running = c.completions.create(
            model=MODEL_ID, prompt="The list", max_tokens=3000, temperature=0, stream=True
        )
        next(iter(running))  # it holds the one slot
        waiting = threading.Thread(
            target=lambda: complete(s.client(), "x", temperature=0, max_tokens=2), daemon=True
        )
        waiting.start()
        deadline = time.monotonic() + 30
        while s.raw("/health", None)[1]["queued"] < 1:  # the second waits in the queue
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.05)
        status, body, headers = s.raw(
            "/v1/completions", json.dumps({"model": MODEL_ID, "prompt": "x"}).encode()
        )
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        assert int(headers["Retry-After"]) >= 1
        running.close()  # frees the slot: the waiting one is served
        waiting.join(60)
        assert not waiting.is_alive()
    finally:
        assert s.stop() == 0


def test_a_client_that_goes_away_frees_its_slot(tmp_path: Path) -> None:
    s = Server(tmp_path, "--local", "--parallel", "1")
    try:
        c = s.client(timeout=2.0)
        stream = c.completions.create(
            model=MODEL_ID, prompt="The list", max_tokens=400, temperature=0, stream=True
        )
        next(iter(stream))
        stream.close()  # gone after its first token: the slot must not decode its 400 tokens first
        t0 = time.monotonic()
        assert complete(s.client(), "The list", temperature=0, max_tokens=4)
        assert time.monotonic() - t0 < 10
    finally:
        assert s.stop() == 0


def test_sigterm_ends_in_flight_requests_cleanly(tmp_path: Path) -> None:
    stats = tmp_path / "routing.json"
    s = Server(tmp_path, "--local", "--parallel", "2", "--stats", str(stats))
    got: list[object] = []

    def ask() -> None:
        try:
            got.append(complete(s.client(), "The list", temperature=0, max_tokens=30))
        except openai.APIError as e:
            got.append(e)

    t = threading.Thread(target=ask)
    t.start()
    time.sleep(0.5)
    s.proc.process.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert s.proc.process.wait(20) == 0
    assert time.monotonic() - t0 < 15
    t.join(20)
    assert got and isinstance(got[0], str)  # finished within the grace period
    assert "swarm serve: stopped" in s.proc.log_tail()
    assert json.loads(stats.read_text())  # the routing statistics were saved on the way out


def test_over_nodes_equal_to_in_process_and_503_when_experts_have_no_holder(
    tmp_path: Path, server: Server
) -> None:
    shard = tmp_path / "m.swarm"
    shard_model(MODEL, shard)
    nodes = start_nodes([(shard, ["--experts", "0-3"]), (shard, ["--experts", "4-7"])], tmp_path / "nodes")
    try:
        peers = [a for n in nodes for a in ("--peer", n.address)]
        s = Server(
            tmp_path,
            "--no-mdns",
            *peers,
            "--timeout",
            "2",
            "--parallel",
            "4",
            "--model-id",
            MODEL_ID,
            source=shard,
        )
        try:
            c = s.client(key="-")
            with cf.ThreadPoolExecutor(4) as ex:
                over_nodes = list(ex.map(lambda p: complete(c, p, temperature=0), PROMPTS[:4]))
            assert over_nodes == [complete(server.client(), p, temperature=0) for p in PROMPTS[:4]]
            nodes[1].process.send_signal(signal.SIGKILL)
            nodes[1].process.wait(
                60
            )  # a SIGKILLed process unmaps its slabs before it is reaped: slow on a busy machine
            errors = []
            for _ in range(2):  # the first finds it gone mid-step, the next before it starts
                with pytest.raises(openai.APIStatusError) as e:
                    complete(c, "The list", temperature=0)
                errors.append(e.value)
            assert all(e.status_code == 503 and "expert" in str(e) for e in errors), errors
        finally:
            assert s.stop() == 0
    finally:
        stop_nodes(nodes)


def test_a_parallel_that_cannot_fit_is_refused_with_the_numbers(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "swarm.coordinator.cli", "serve", str(MODEL), "--local", "--port", "0",
         "--parallel", "1000", "--ctx-size", "10000000"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert "--parallel 1000 at --ctx-size 10000000 needs 1000 x" in err and "available" in err
    assert "Traceback" not in proc.stderr


def test_a_node_caught_lying_mid_batch_changes_no_text(tmp_path: Path, server: Server) -> None:
    """Four conversations decode together over an honest node and one whose slabs are damaged after it was
    admitted: the audits catch it, the passes since the last checked point are done again for every
    conversation, and each text is its in-process text alone."""
    import shutil

    from test_audit import damage, read_in_place

    honest_dir, liar_dir = tmp_path / "honest.swarm", tmp_path / "liar.swarm"
    shard_model(MODEL, honest_dir)
    shutil.copytree(honest_dir, liar_dir)
    # the liar's own check of its files off: damaged under it, they reach its answers
    nodes = start_nodes([(honest_dir, []), (liar_dir, ["--recheck", "0"])], tmp_path / "nodes")
    nodes[1].wait_prepared(60)  # every slab hashed before its first use: the damage comes after
    try:
        peers = [a for n in nodes for a in ("--peer", n.address)]
        s = Server(tmp_path, "--no-mdns", *peers, "--audit", "1", "--parallel", "4", "--model-id", MODEL_ID,
                   source=honest_dir)  # fmt: skip
        try:
            c = s.client(key="-")
            assert complete(c, "The list", temperature=0, max_tokens=2)  # both nodes admitted while honest
            assert read_in_place(2) and read_in_place(3)  # else the damage could not reach its answers
            damage(liar_dir, 2, list(range(8)))
            damage(liar_dir, 3, list(range(8)))
            with cf.ThreadPoolExecutor(4) as ex:
                texts = list(ex.map(lambda p: complete(c, p, temperature=0), PROMPTS[:4]))
            assert texts == [complete(server.client(), p, temperature=0) for p in PROMPTS[:4]]
            assert f"banned node {nodes[1].address}" in s.proc.log_tail(200)
        finally:
            assert s.stop() == 0
    finally:
        stop_nodes(nodes)
