"""Pictures through the text model (coordinator/text/pictures.py, models' M-RoPE positions) against llama.cpp's mtmd
and transformers on the tiny fixture in tests/fixtures/qwen35moe-vision: the prompt's tokens, logits at every
position within the fixture's floors, greedy tokens, chunks and checkpoints inside a picture, three nodes bit
for bit equal to in process, and `swarm serve` driven by the official `openai` client."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FIXTURES
from PIL import Image

from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import forward_one, generate
from swarm.coordinator.decode.sampling import SamplingParams
from swarm.coordinator.engine import Engine, open_engine
from swarm.coordinator.models.base import PictureRows
from swarm.coordinator.text.pictures import PicturePrompt, run_prompt
from swarm.proto.numerics import Numerics

FIX = FIXTURES / "qwen35moe-vision"
MODEL, MMPROJ = FIX / "model-f32.gguf", FIX / "mmproj-f32.gguf"
PICTURES = {"A": "image_A_96x96.png", "B": "image_B_160x64.png", "C": "image_C_100x70.png"}
# the fixture's prompts (its meta.json): pictures and question of each
PROMPTS = [(["A"], "What do you see here?"), (["B"], "Read the picture."), (["A", "B"], "Which picture is brighter?"),
           (["C"], "Describe it.")]  # fmt: skip
# the fixture's floors (its README, "Tolerances"): the text model on identical rows, and end to end against
# llama.cpp, whose fp16-table GELU moves its picture rows ~1.9e-3 from any other implementation
TEXT_MAX, TEXT_KL = 2e-3, 1e-8
LLAMA_MAX, LLAMA_KL = 0.2, 1e-4


@pytest.fixture(scope="module")
def ref() -> Any:
    return np.load(FIX / "reference.npz")


@pytest.fixture(scope="module")
def engines() -> Any:
    made = {n: open_engine(MODEL, EngineConfig(local=True, device="cpu", numerics=n, mmproj=MMPROJ)) for n in Numerics}
    yield made
    for e in made.values():
        e.close()


def picture(name: str) -> bytes:
    return (FIX / PICTURES[name]).read_bytes()


def prompt_of(engine: Engine, i: int) -> PicturePrompt:
    names, question = PROMPTS[i]
    return run_prompt(engine, question, True, None, [picture(n) for n in names])


def mean_kl(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of KL(softmax(a) || softmax(b)), float64."""
    la = torch.log_softmax(torch.as_tensor(a, dtype=torch.float64), -1)
    lb = torch.log_softmax(torch.as_tensor(b, dtype=torch.float64), -1)
    return float((la.exp() * (la - lb)).sum(-1).mean())


def within(got: torch.Tensor, want: np.ndarray, max_diff: float, kl: float, what: str) -> None:
    g = got.float().numpy()
    d, k = float(np.abs(g - want).max()), mean_kl(want, g)
    assert d <= max_diff and k <= kl, f"{what}: max |diff| {d:.3g} (<= {max_diff}), mean KL {k:.3g} (<= {kl})"


@pytest.mark.parametrize("i", range(4))
def test_prompt_tokens_and_positions_are_mtmds(engines: Any, ref: Any, i: int) -> None:
    p = prompt_of(engines[Numerics.NATIVE], i)
    assert p.tokens == ref[f"tokens_{i}"].tolist()
    assert p.pictures is not None and p.pictures.at.tolist() == np.nonzero(ref[f"is_image_{i}"])[0].tolist()
    assert np.array_equal(p.pictures.positions.numpy(), ref[f"llama_positions_{i}"][:3])
    # the slot keys: a picture's rows as numbers of its pixels, the rest the tokens
    assert [k for k in p.keys if k >= 0] == [
        t for t, m in zip(p.tokens, ref[f"is_image_{i}"], strict=True) if not m
    ]
    assert all(p.keys[j] < 0 for j in p.pictures.at.tolist())


@pytest.mark.parametrize(("numerics", "engine_name"), [(Numerics.EXACT, "hf"), (Numerics.NATIVE, "llama")])
@pytest.mark.parametrize("i", range(3))
def test_text_model_on_the_references_rows_within_the_floor(
    engines: Any, ref: Any, i: int, numerics: Numerics, engine_name: str
) -> None:
    """Each engine's own picture rows in, its logits at every position out: the text model's floor."""
    model = engines[numerics].model
    tokens, mask = ref[f"tokens_{i}"], ref[f"is_image_{i}"]
    pictures = PictureRows(
        torch.from_numpy(np.nonzero(mask)[0]),
        torch.from_numpy(ref[f"{engine_name}_image_embd_{i}"]),
        torch.from_numpy(ref[f"hf_positions_{i}"][:, : len(tokens)].astype(np.int64)),
    )
    got = forward_one(model, tokens.tolist(), model.new_state(), "cpu", pictures=pictures)
    within(got, ref[f"{engine_name}_logits_{i}"], TEXT_MAX, TEXT_KL, f"prompt {i} on {engine_name}'s rows")


@pytest.mark.parametrize("i", range(4))
def test_pictures_end_to_end_within_the_floors_and_greedy_tokens_equal(
    engines: Any, ref: Any, i: int
) -> None:
    """From the PNG files: --exact against transformers (on the llama.cpp-style canvas for the resized picture
    C), native against llama.cpp; 8 greedy tokens equal to both engines'."""
    hf = f"hf_llstyle_logits_{i}" if i == 3 else f"hf_logits_{i}"
    greedy = ref[f"hf_llstyle_greedy_{i}" if i == 3 else f"hf_greedy_{i}"].tolist()
    assert greedy == ref[f"llama_greedy_{i}"].tolist()  # (the fixture's engines agree on every prompt)
    for numerics, want, tol in ((Numerics.EXACT, hf, (TEXT_MAX, TEXT_KL)),
                                (Numerics.NATIVE, f"llama_logits_{i}", (LLAMA_MAX, LLAMA_KL))):  # fmt: skip
        e = engines[numerics]
        p = prompt_of(e, i)
        got = forward_one(e.model, p.tokens, e.model.new_state(), "cpu", pictures=p.pictures)
        within(got, ref[want], *tol, f"prompt {i} {numerics.value} vs {want}")
        params = SamplingParams(max_tokens=8, temperature=0.0)
        assert list(generate(e.model, p.tokens, params, "cpu", pictures=p.pictures)) == greedy


def test_a_text_prompt_is_unchanged_by_picture_positions(engines: Any) -> None:
    """Text tokens given with their (p, p, p) positions explicitly: the same bits as without."""
    for e in engines.values():
        ids = e.tokenizer.encode("def add(a, b): return a + b", parse_special=False)
        pictures = PictureRows(
            torch.zeros(0, dtype=torch.long), torch.zeros(0, 128), torch.arange(len(ids)).expand(3, -1)
        )
        a = forward_one(e.model, ids, e.model.new_state(), "cpu")
        b = forward_one(e.model, ids, e.model.new_state(), "cpu", pictures=pictures)
        assert torch.equal(a, b)


@pytest.mark.parametrize("numerics", list(Numerics))
def test_a_picture_cut_into_chunks_and_checkpoints_gives_the_same_bits(
    engines: Any, numerics: Numerics
) -> None:
    """Prompt 2 read in chunks cut inside both pictures, with marks there, and continued from a checkpoint
    restored inside a picture: the logits of reading it in one call, bit for bit; the next position kept."""
    model = engines[numerics].model
    p = prompt_of(engines[numerics], 2)
    assert p.pictures is not None
    whole_state = model.new_state()
    whole = forward_one(model, p.tokens, whole_state, "cpu", pictures=p.pictures)
    assert whole_state.position == 39 and whole_state.length == 50  # the fixture's: 15 + 24 text positions
    st, parts = model.new_state(), []
    cuts = [0, 7, 12, 20, 50]
    for a, b in zip(cuts, cuts[1:], strict=False):
        ids = torch.tensor(p.tokens[a:b])
        pictures = p.pictures.slice(a, b)
        parts.append(model(ids, [st], [b - a], marks=[3], **({"pictures": [pictures]} if pictures else {})))
        if a == 12:
            inside = st.marked[-1]  # after token 15: between the pictures (vision_end, vision_start read)
        elif a == 20:
            deep = st.marked[-1]  # after token 23: inside picture B
    assert torch.equal(torch.cat(parts), whole)
    assert st.position == whole_state.position
    for cp in (inside, deep):
        at = cp.length
        st.restore(cp)
        again = model(torch.tensor(p.tokens[at:]), [st], [50 - at], pictures=[p.pictures.slice(at, 50)])
        assert torch.equal(again, whole[at:]) and st.position == 39


def tiny_png(width: int, height: int, declare: tuple[int, int] | None = None) -> bytes:
    """A PNG of solid grey; `declare`: the size its header claims instead (a decompression bomb's)."""
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 150)).save(buf, "PNG")
    data = buf.getvalue()
    if declare is None:
        return data
    ihdr = struct.pack(">II", *declare) + data[24:29]
    return data[:16] + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)) + data[33:]


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def test_bombs_and_other_bad_pictures_are_user_errors(engines: Any) -> None:
    from swarm.coordinator.serve.openai_request import ApiError, JobReader

    e = engines[Numerics.NATIVE]
    from swarm.coordinator.text.chat import ChatTemplate

    reader = JobReader(e.tokenizer, ChatTemplate.from_tokenizer(e.tokenizer), 256, e.vision)

    def ask(url: str) -> str:
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}]
        with pytest.raises(ApiError) as err:
            reader.chat_job({"messages": [{"role": "user", "content": parts}]})
        assert err.value.status == 400
        return err.value.message

    assert "none of PNG" in ask(data_url(b"hello, not a picture"))
    assert "truncated" in ask(data_url(picture("A")[:5000]))
    assert "decompression bomb" in ask(data_url(tiny_png(8, 8, declare=(100_000, 100_000))))
    assert "base64" in ask("data:image/png;base64,@@@")
    assert "--allow-image-urls" in ask("http://127.0.0.1:1/a.png")
    assert "pictures' rows" in ask(data_url(tiny_png(1024, 1024)))  # 1024 rows > the 256-token context


def test_image_urls_are_fetched_when_allowed(engines: Any) -> None:
    import http.server
    import threading

    from swarm.coordinator.serve.openai_request import ApiError, JobReader
    from swarm.coordinator.text.chat import ChatTemplate

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            found = self.path == "/a.png"
            self.send_response(200 if found else 404)
            self.end_headers()
            if found:
                self.wfile.write(picture("A"))

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    e = engines[Numerics.NATIVE]
    reader = JobReader(
        e.tokenizer, ChatTemplate.from_tokenizer(e.tokenizer), 256, e.vision, allow_image_urls=True
    )
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        for path, ok in (("/a.png", True), ("/missing.png", False)):
            parts = [
                {"type": "image_url", "image_url": {"url": base + path}},
                {"type": "text", "text": PROMPTS[0][1]},
            ]
            body = {"messages": [{"role": "user", "content": parts}]}
            if ok:
                job = reader.chat_job(body)
                assert job.prompt == prompt_of(e, 0).tokens and job.pictures is not None
            else:
                with pytest.raises(ApiError, match="cannot fetch"):
                    reader.chat_job(body)
    finally:
        httpd.shutdown()


@pytest.mark.slow
def test_three_nodes_equal_in_process_bit_for_bit(tmp_path: Path, ref: Any) -> None:
    from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
    from swarm.sharding.shard import shard_model

    shard = tmp_path / "m.swarm"
    shard_model(MODEL, shard)
    nodes = start_nodes([(shard, ["--experts", r]) for r in ("0-4", "5-10", "11-15")], tmp_path / "nodes")
    try:
        peers = tuple(n.address for n in nodes)
        swarm = open_engine(shard, EngineConfig(peers=peers, mdns=False, device="cpu", mmproj=MMPROJ))
        local = open_engine(shard, EngineConfig(local=True, device="cpu", mmproj=MMPROJ))
        try:
            assert set(peers) <= set(swarm.experts.clients)
            params = SamplingParams(max_tokens=8, temperature=0.0)
            for i in range(3):
                p, q = prompt_of(swarm, i), prompt_of(local, i)
                assert p.tokens == q.tokens and p.pictures is not None and q.pictures is not None
                assert torch.equal(p.pictures.rows, q.pictures.rows)
                a = forward_one(swarm.model, p.tokens, swarm.model.new_state(), "cpu", pictures=p.pictures)
                b = forward_one(local.model, q.tokens, local.model.new_state(), "cpu", pictures=q.pictures)
                assert torch.equal(a, b), f"prompt {i}: max {float((a - b).abs().max()):.3g}"
                greedy = list(
                    generate(swarm.model, p.tokens, params, "cpu", checker=swarm.checker, pictures=p.pictures)
                )
                assert greedy == list(generate(local.model, q.tokens, params, "cpu", pictures=q.pictures))
                assert greedy == ref[f"llama_greedy_{i}"].tolist()
            assert set(peers) <= set(swarm.experts.calls_per_node), "every node got calls"
        finally:
            swarm.close()
            local.close()
    finally:
        stop_nodes(nodes)


@pytest.mark.slow
def test_swarm_run_reads_pictures(tmp_path: Path, engines: Any, ref: Any) -> None:
    """`swarm run --image` (the mmproj found beside the model), and its errors: a picture that is not one, and
    a model without an mmproj."""
    import subprocess
    import sys

    def run(model: Path, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "swarm.coordinator.cli", "run", str(model), "--local", "--max-tokens", "8",
               "--draft", "none", *args]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    names, question = PROMPTS[2]
    images = [a for n in names for a in ("--image", str(FIX / PICTURES[n]))]
    done = run(MODEL, "--chat", "--prompt", question, *images)
    assert done.returncode == 0, done.stderr
    want = engines[Numerics.NATIVE].tokenizer.decode(ref["llama_greedy_2"].tolist(), skip_control=True)
    assert done.stdout.rstrip("\n") == want
    (tmp_path / "not.png").write_bytes(b"hello")
    bad = run(MODEL, "--prompt", "x", "--image", str(tmp_path / "not.png"))
    assert bad.returncode != 0 and "none of PNG" in bad.stderr and "Traceback" not in bad.stderr
    alone = tmp_path / "model.gguf"
    alone.symlink_to(MODEL)
    bad = run(alone, "--prompt", "x", "--image", str(FIX / PICTURES["A"]))
    assert bad.returncode != 0 and "--mmproj" in bad.stderr and "Traceback" not in bad.stderr


# ---- swarm serve, driven by the official openai client ----

KEY = "test-api-key"
MODEL_ID = "model-f32"


class Server:
    def __init__(self, tmp: Path, name: str, *args: str) -> None:
        from swarm.coordinator.cli.launch import spawn_server

        common = ["--local", "--parallel", "1", "--ctx-size", "256", "--api-key", KEY]
        self.proc = spawn_server(MODEL, [*common, *args], tmp, name).wait_ready(120)
        self.url = self.proc.ready["url"]

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0)

    def chat(self, messages: list[dict[str, Any]], max_tokens: int = 8) -> Any:
        raw = self.client().chat.completions.with_raw_response.create(
            model=MODEL_ID, messages=messages, max_tokens=max_tokens, temperature=0
        )
        body = json.loads(raw.text)
        # the template opens <think>: the answer's text is its reasoning, then its content (as in_process decodes)
        for choice in body.get("choices", []):
            m = choice["message"]
            m["content"] = (m.pop("reasoning_content", None) or "") + (m.get("content") or "")
        return body


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("serve")
    vision = Server(tmp, "vision", "--mmproj", str(MMPROJ))
    try:
        text = Server(tmp, "text", "--no-mmproj")
    except BaseException:
        vision.proc.stop()
        raise
    yield vision, text
    assert vision.proc.stop() == 0, vision.proc.log_tail()
    assert text.proc.stop() == 0, text.proc.log_tail()


def user(names: list[str], text: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": data_url(picture(n))}} for n in names
    ]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def in_process(e: Engine, messages: list[dict[str, Any]], max_tokens: int = 8) -> tuple[str, int]:
    """(the answer, prompt tokens) of a chat computed here, as the server reads it."""
    from swarm.coordinator.serve.openai_request import JobReader
    from swarm.coordinator.text.chat import ChatTemplate

    job = JobReader(e.tokenizer, ChatTemplate.from_tokenizer(e.tokenizer), 256, e.vision).chat_job(
        {"messages": messages}
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_ids=e.tokenizer.eos_ids)
    tokens = list(generate(e.model, job.prompt, params, "cpu", pictures=job.pictures))
    return e.tokenizer.decode([t for t in tokens if t not in params.stop_ids], skip_control=True), len(
        job.prompt
    )


@pytest.mark.slow
def test_serve_answers_pictures_as_in_process(servers: Any, engines: Any, ref: Any) -> None:
    vision, text = servers
    e = engines[Numerics.NATIVE]
    models = vision.client().models.list().data
    assert [m.id for m in models] == [MODEL_ID] and models[0].model_extra["input_modalities"] == [
        "text",
        "image",
    ]
    assert text.client().models.list().data[0].model_extra["input_modalities"] == ["text"]
    for i in range(3):
        names, question = PROMPTS[i]
        body = vision.chat([user(names, question)])
        assert body["usage"]["prompt_tokens"] == len(ref[f"tokens_{i}"])
        want = e.tokenizer.decode(ref[f"llama_greedy_{i}"].tolist(), skip_control=True)
        assert body["choices"][0]["message"]["content"] == want == in_process(e, [user(names, question)])[0]
    # a chat without pictures: the same answer with and without the vision tower
    plain = [{"role": "user", "content": "What is a list?"}]
    assert vision.chat(plain, 12)["choices"][0]["message"] == text.chat(plain, 12)["choices"][0]["message"]


@pytest.mark.slow
def test_a_resent_conversation_keeps_its_pictures_and_a_new_picture_restarts(
    servers: Any, engines: Any
) -> None:
    vision, _ = servers
    e = engines[Numerics.NATIVE]
    first = [user(["A"], "What do you see here?")]
    answer = vision.chat(first)
    history = [*first, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
               {"role": "user", "content": "And then?"}]  # fmt: skip
    again = vision.chat(history)
    # every token before the first answer's generation prompt (<|im_start|>assistant\n<think>\n: 7 tokens)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= answer["usage"]["prompt_tokens"] - 7
    assert again["choices"][0]["message"]["content"] == in_process(e, history)[0]
    # the same conversation with picture B in A's place: nothing held is used from the picture on
    other = [user(["B"], "What do you see here?"), *history[1:]]
    body = vision.chat(other)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] <= 5  # <|im_start|>user\n<|vision_start|>
    assert body["choices"][0]["message"]["content"] == in_process(e, other)[0]


@pytest.mark.slow
def test_bad_pictures_get_400s_that_say_what_is_wrong(servers: Any) -> None:
    import openai

    vision, text = servers

    def refused(server: Server, url: str) -> str:
        with pytest.raises(openai.BadRequestError) as err:
            server.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What?"}]}])  # fmt: skip
        return f"{err.value.code}: {err.value}"

    assert "none of PNG" in refused(vision, data_url(b"hello, not a picture"))
    assert "truncated" in refused(vision, data_url(picture("A")[:5000]))
    assert "decompression bomb" in refused(vision, data_url(tiny_png(8, 8, declare=(100_000, 100_000))))
    assert "--allow-image-urls" in refused(vision, "https://example.com/a.png")
    too_many = refused(vision, data_url(tiny_png(1024, 1024)))
    assert "context_length_exceeded" in too_many and "pictures' rows" in too_many
    assert "--mmproj" in refused(text, data_url(picture("A")))
    # the server still answers
    assert vision.chat([user(["A"], "What do you see here?")])["choices"][0]["message"]["content"]


def test_several_requests_with_pictures_decode_together_each_as_alone(engines: Any) -> None:
    """Four requests, three with pictures (one with two) and one without, read and decoded together by the serve
    scheduler (prompt chunks of several beside each other, cut inside pictures): each gets the tokens it gets
    alone, greedy and sampled."""
    import threading

    from swarm.coordinator.serve import scheduler as sched

    e = engines[Numerics.NATIVE]
    prompts = [prompt_of(e, i) for i in range(3)]
    prompts.append(run_prompt(e, "What is a list?", True, None, []))
    params = [SamplingParams(max_tokens=6, temperature=0.8 * (i % 2), seed=9 + i) for i in range(4)]
    alone = [
        list(generate(e.model, p.tokens, q, "cpu", pictures=p.pictures))
        for p, q in zip(prompts, params, strict=True)
    ]
    s = sched.Scheduler(e.model, torch.device("cpu"), None, 4, 256, 4)
    s.start()
    try:
        done = [threading.Event() for _ in range(4)]
        outs: list[list[int]] = [[] for _ in range(4)]
        for i, p in enumerate(prompts):
            r = sched.Request(
                p.tokens,
                params[i],
                outs[i].extend,
                lambda _, d=done[i]: d.set(),
                pictures=p.pictures,
                keys=p.keys,
            )
            s.submit(r)
        assert all(d.wait(120) for d in done)
    finally:
        s.stop()
    assert outs == alone
