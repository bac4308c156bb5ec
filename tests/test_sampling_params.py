"""The sampling a client asks for (presence / frequency / repetition penalties, min_p, logprobs and
top_logprobs) against a reference computed here, independently: numpy over the logits of the same model fed
one token at a time (forward_one), the penalties and log-softmax written out as OpenAI and vLLM define them.
The server drafts by prompt lookup (its default) and the reference feeds one token a pass, so the same tokens
both ways also say that drafts change nothing."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from conftest import FIXTURES

from swarm.coordinator.cli.launch import spawn_server
from swarm.coordinator.config import EngineConfig
from swarm.coordinator.decode.one import forward_one
from swarm.coordinator.engine import open_engine
from swarm.coordinator.text.tokenizer import GGUFTokenizer
from swarm.sharding.gguf_io import open_gguf, read_metadata

MODEL = FIXTURES / "qwen35moe-tiny" / "model-f32.gguf"
# repeats itself, so that prompt lookup drafts and the penalties have something to bite on
PROMPT = "one two three one two three one two three one two"
# a negative presence penalty makes random weights repeat themselves, so that the other two bite too
PRESENCE, FREQUENCY, REPETITION, TOP, STEPS = -1.5, 1.0, 0.7, 5, 14

pytestmark = pytest.mark.slow
TOKENIZER = GGUFTokenizer(read_metadata(open_gguf(MODEL)))


def text_of(token: int) -> str:
    return TOKENIZER.token_bytes(token).decode("utf-8", errors="replace")


def reference(presence: float, frequency: float, repetition: float) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and each position's log-probabilities [V] (float64), one token a pass."""
    engine = open_engine(MODEL, EngineConfig(local=True))
    try:
        prompt = engine.tokenizer.encode(PROMPT, parse_special=False)
        state = engine.model.new_state()
        row = forward_one(engine.model, prompt, state, engine.device, last_only=True)[-1]
        tokens: list[int] = []
        logprobs = []
        for _ in range(STEPS):
            x = row.float().cpu().numpy().astype(np.float64)
            for t in set(prompt + tokens):  # repetition: every token of the prompt or the answer
                x[t] = x[t] / repetition if x[t] > 0 else x[t] * repetition
            for t in set(tokens):  # presence and frequency: the answer's tokens
                x[t] -= presence + frequency * tokens.count(t)
            lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
            token = int(np.argmax(lp))
            tokens.append(token)
            logprobs.append(lp)
            if token in engine.tokenizer.eos_ids:
                break
            row = forward_one(engine.model, [token], state, engine.device, last_only=True)[-1]
        return tokens, logprobs
    finally:
        engine.close()


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    args = ["--local", "--parallel", "2", "--ctx-size", "512", "--model-id", "m"]
    proc = spawn_server(MODEL, args, tmp_path_factory.mktemp("sampling")).wait_ready(120)
    try:
        yield openai.OpenAI(base_url=proc.ready["url"], api_key="-", max_retries=0)
    finally:
        assert proc.stop() == 0, proc.log_tail()


def test_penalties_and_logprobs_equal_the_reference(client: openai.OpenAI) -> None:
    tokens, logprobs = reference(PRESENCE, FREQUENCY, REPETITION)
    plain, _ = reference(0.0, 0.0, 1.0)
    assert tokens != plain, "the penalties change the answer"
    r = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=STEPS, temperature=0, logprobs=TOP,
        extra_body={"presence_penalty": PRESENCE, "frequency_penalty": FREQUENCY,
                    "repetition_penalty": REPETITION},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    shown = [t for t in tokens if t < 760]  # EOS has no text and no entry
    assert len(lp.token_logprobs) == len(shown)
    assert np.allclose(lp.token_logprobs, [logprobs[i][t] for i, t in enumerate(shown)], atol=2e-4)
    for i, top in enumerate(lp.top_logprobs):
        want: dict[str, float] = {}  # the legacy shape maps a token's text: the likelier of two alike
        for t in np.argsort(-logprobs[i], kind="stable")[:TOP]:
            want.setdefault(text_of(int(t)), float(logprobs[i][t]))
        assert top.keys() == want.keys(), i
        assert np.allclose([top[k] for k in want], list(want.values()), atol=2e-4), i
    assert "".join(lp.tokens) == r.choices[0].text

    # the chat API's shape, through the official client: the same numbers for its answer's first token
    c = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=3, presence_penalty=PRESENCE,
    )  # fmt: skip
    first = c.choices[0].logprobs.content[0]
    assert [t.logprob for t in first.top_logprobs] == sorted(
        (t.logprob for t in first.top_logprobs), reverse=True
    )
    assert first.token == first.top_logprobs[0].token and first.logprob == first.top_logprobs[0].logprob
    assert bytes(first.bytes).decode("utf-8", errors="replace") == first.token


def test_streamed_logprobs_add_up_to_the_whole_answers(client: openai.OpenAI) -> None:
    kw = {"model": "m", "max_tokens": 8, "temperature": 0}
    whole = client.completions.create(prompt=PROMPT, logprobs=2, **kw)
    streamed = [
        c.choices[0].logprobs for c in client.completions.create(prompt=PROMPT, logprobs=2, stream=True, **kw)
    ]
    assert [x for lp in streamed if lp for x in lp.token_logprobs] == whole.choices[0].logprobs.token_logprobs
    assert [x for lp in streamed if lp for x in lp.text_offset] == whole.choices[0].logprobs.text_offset
    msgs = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=2, **kw)
    chunks = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=2, stream=True, **kw)
    got = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert got == chat.choices[0].logprobs.content and len(got) > 1


def test_each_streamed_chat_chunk_carries_its_own_tokens_logprobs(client: openai.OpenAI) -> None:
    """As OpenAI streams them: a chunk's logprobs are those of the tokens whose text it carries, not all with the
    last chunk (thinking off and left in content, so the content is the tokens' text as it is)."""
    chunks = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0, logprobs=True,
        stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": False}, "reasoning_format": "none"},
    )  # fmt: skip
    text, tokens, carrying = "", b"", 0  # bytes: a token may hold part of a character
    for c in chunks:
        if not c.choices:
            continue
        lp = c.choices[0].logprobs
        tokens += b"".join(bytes(e.bytes or []) for e in lp.content) if lp else b""
        text += c.choices[0].delta.content or ""
        carrying += bool(lp and lp.content)
        # no chunk's text comes before its tokens' logprobs (bytes that are no UTF-8 are U+FFFD in the text)
        assert tokens.decode(errors="replace").startswith(text), (tokens, text)
        if c.choices[0].delta.content:
            assert lp is not None and lp.content  # a chunk with text carries its tokens'
    assert tokens.decode(errors="replace") == text and carrying > 2


def test_min_p_of_one_leaves_only_the_likeliest_token(client: openai.OpenAI) -> None:
    greedy = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0)
    hot = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=10, temperature=1.5, seed=3, extra_body={"min_p": 1.0}
    )
    free = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=1.5, seed=3)
    assert hot.choices[0].text == greedy.choices[0].text != free.choices[0].text


@pytest.mark.parametrize(
    "field",
    [
        {"presence_penalty": 3},
        {"frequency_penalty": "a"},
        {"repetition_penalty": 0},
        {"min_p": 1.5},
        {"logprobs": True, "top_logprobs": 21},
        {"top_logprobs": 2},
        {"logprobs": "yes"},
    ],
)
def test_bad_values_are_a_400_naming_the_field(client: openai.OpenAI, field: dict) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body=field
        )
    assert e.value.body["param"] in field, e.value.body
