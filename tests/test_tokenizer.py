"""Tokenizer and chat template from GGUF metadata, checked against independent references.

References: llama.cpp's own tokenizer test vectors for the `qwen35` pre-tokenizer over the 151,936-token Qwen
vocabulary (tests/fixtures/tokenizer), and the prompt ids each fixture model recorded with transformers and
cross-checked with llama.cpp (meta.json -> prompts).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES

from swarm.coordinator.text.chat import CHATML_TEMPLATE, ChatTemplate, TemplateRaised
from swarm.coordinator.text.tokenizer import PRE_TOKENIZER_PATTERNS, GGUFTokenizer
from swarm.sharding.errors import UserError
from swarm.sharding.gguf_io import open_gguf, read_metadata

VOCAB_DIR = FIXTURES / "tokenizer"
VOCAB_GGUF = VOCAB_DIR / "ggml-vocab-qwen35.gguf"
SEPARATOR = "\n__ggml_vocab_test__\n"

# Fixture model -> the pre-tokenizer its GGUF must select.
MODEL_PRE = {
    "qwen2moe-tiny": "qwen2",
    "qwen3moe-tiny": "qwen2",
    "qwen3next-tiny": "qwen2",
    "qwen35moe-tiny": "qwen35",
    "qwen35moe-quant": "qwen35",
}


def _read_meta(path: Path) -> dict[str, Any]:
    return read_metadata(open_gguf(path))


def _vocab_cases() -> list[tuple[str, list[int]]]:
    # Bytes, not text mode, so that \r and \r\n stay in the test strings exactly as written.
    inputs = (VOCAB_DIR / "ggml-vocab-qwen35.gguf.inp").read_bytes().decode("utf-8").split(SEPARATOR)
    lines = (VOCAB_DIR / "ggml-vocab-qwen35.gguf.out").read_bytes().decode("utf-8").split("\n")
    assert len(inputs) == len(lines), (len(inputs), len(lines))
    return [(text, [int(x) for x in line.split()]) for text, line in zip(inputs, lines, strict=True)]


VOCAB_CASES = _vocab_cases()


@pytest.fixture(scope="module")
def vocab_meta() -> dict[str, Any]:
    # gguf's reader spends several seconds on the 300k strings of this file; read it once per module.
    return _read_meta(VOCAB_GGUF)


@pytest.fixture(scope="module")
def qwen_vocab(vocab_meta: dict[str, Any]) -> GGUFTokenizer:
    return GGUFTokenizer(vocab_meta)


@pytest.fixture(scope="module")
def tiny_meta() -> dict[str, Any]:
    return _read_meta(FIXTURES / "qwen35moe-tiny" / "model-f32.gguf")


@pytest.fixture(scope="module")
def tiny(tiny_meta: dict[str, Any]) -> GGUFTokenizer:
    return GGUFTokenizer(tiny_meta)


# --- llama.cpp's test vectors over the full Qwen vocabulary -------------------------------------------


def test_vector_file_has_every_case() -> None:
    expected = json.loads((VOCAB_DIR / "check.json").read_text())["n_cases"]
    assert len(VOCAB_CASES) == expected == 51


@pytest.mark.slow
def test_build_151k_vocab_is_fast(vocab_meta: dict[str, Any]) -> None:
    timings = []
    for _ in range(3):
        start = time.process_time()  # CPU time: what the build costs, whatever else the machine runs
        tok = GGUFTokenizer(vocab_meta)
        timings.append(time.process_time() - start)
    build = sorted(timings)[1]
    logging.getLogger(__name__).info("151,936-token tokenizer built in %.3f s (median of 3)", build)
    assert tok.vocab_size == 151936
    assert tok.pre == "qwen35"
    assert build < 2.0, f"building the tokenizer took {build:.2f} s"


@pytest.mark.slow
@pytest.mark.parametrize(("text", "ids"), VOCAB_CASES, ids=[f"case{i}" for i in range(len(VOCAB_CASES))])
def test_llamacpp_vectors(qwen_vocab: GGUFTokenizer, text: str, ids: list[int]) -> None:
    assert qwen_vocab.encode(text, parse_special=False) == ids
    assert qwen_vocab.decode(ids) == text


@pytest.mark.slow
def test_qwen_vocab_specials(qwen_vocab: GGUFTokenizer) -> None:
    assert qwen_vocab.eos_ids == {151643, 151645}  # <|endoftext|> (declared eos) and <|im_end|>
    assert qwen_vocab.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
    plain = qwen_vocab.encode("<|im_start|>", parse_special=False)
    assert 151644 not in plain and qwen_vocab.decode(plain) == "<|im_start|>"
    assert not qwen_vocab.add_bos and qwen_vocab.encode("Hello")[0] != qwen_vocab.bos_id


@pytest.mark.slow
def test_qwen_vocab_streaming_multibyte(qwen_vocab: GGUFTokenizer) -> None:
    held_back = 0
    for text, ids in VOCAB_CASES:
        stream = qwen_vocab.stream()
        pieces = [stream.push(i) for i in ids]
        held_back += pieces.count("")
        pieces.append(stream.flush())
        assert "".join(pieces) == qwen_vocab.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)
    assert held_back > 0  # some emoji / CJK / Khmer characters span several tokens


@pytest.mark.slow
def test_qwen2_style_template_of_vocab_file(vocab_meta: dict[str, Any], qwen_vocab: GGUFTokenizer) -> None:
    template = ChatTemplate.from_metadata(vocab_meta)
    text = template.render([{"role": "user", "content": "hi"}])
    # That template inserts a default system prompt when the conversation has none.
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert qwen_vocab.encode(text).count(151644) == 3


# --- the fixture models' own tokenizers and prompts ------------------------------------------------------


def _model_cases() -> list[tuple[str, Path]]:
    return [(model, path) for model in MODEL_PRE for path in sorted((FIXTURES / model).glob("*.gguf"))]


@pytest.mark.parametrize(("model", "path"), _model_cases(), ids=lambda v: v if isinstance(v, str) else v.name)
def test_fixture_prompts(model: str, path: Path) -> None:
    meta = _read_meta(path)
    tok = GGUFTokenizer(meta)
    assert tok.pre == MODEL_PRE[model]
    assert tok.vocab_size == len(meta["tokenizer.ggml.tokens"])
    template = ChatTemplate.from_tokenizer(tok)
    assert not template.is_fallback
    prompts = json.loads((FIXTURES / model / "meta.json").read_text())["prompts"]
    checked = set()
    for prompt in prompts:
        if prompt["kind"] == "random":
            continue  # random ids, no text
        if prompt["kind"] == "chat":
            rendered = template.render(
                prompt["messages"], add_generation_prompt=True, **prompt["chat_kwargs"]
            )
            assert rendered == prompt["text"]
        assert tok.encode(prompt["text"]) == prompt["ids"], prompt["kind"]
        assert tok.decode(prompt["ids"]) == prompt["text"]
        checked.add(prompt["kind"])
    assert checked == {"text", "chat", "short"}


# --- behaviour on the tiny vocabulary (768 tokens: most characters are split into bytes) ---------------


def test_special_tokens(tiny: GGUFTokenizer) -> None:
    assert tiny.eos_ids == {760, 762}  # <|endoftext|>, <|im_end|> (declared eos)
    assert tiny.encode("<|im_start|>") == [761]
    assert 761 not in tiny.encode("<|im_start|>", parse_special=False)
    # USER_DEFINED tokens are matched whole even without parse_special, as in llama.cpp.
    assert tiny.encode("<think>x</think>", parse_special=False)[::2] == [763, 764]
    ids = tiny.encode("<|im_start|>user\nhi<think><|im_end|>")
    assert tiny.decode(ids) == "<|im_start|>user\nhi<think><|im_end|>"
    assert tiny.decode(ids, skip_control=True) == "user\nhi<think>"
    assert tiny.decode([765]) == ""  # [PAD765] is UNUSED filler
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.decode([768])


def test_streaming_holds_back_partial_characters(tiny: GGUFTokenizer) -> None:
    for text in ["我想在apple工作1314151天～", "emoji 😶‍🌫️ and 🦙.cpp", "Äpfel, Cửa Việt, нещо", "ok"]:
        ids = tiny.encode(text)
        assert len(ids) > len(text.encode("utf-8")) // 4  # the tiny vocab does split characters
        stream = tiny.stream()
        pieces = [stream.push(i) for i in ids]
        pieces.append(stream.flush())
        assert "".join(pieces) == tiny.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)
        assert list(tiny.stream().iter_text(ids)) == [p for p in pieces if p]
    # A stream that stops inside a character ends like decode does: one replacement character.
    cut = tiny.encode("天")[:-1]
    stream = tiny.stream()
    assert stream.push_many(cut) == ""
    assert stream.flush() == tiny.decode(cut) == "\ufffd"


def test_pre_tokenizers_differ_on_combining_marks(tiny: GGUFTokenizer) -> None:
    # llama.cpp's vectors above pass with either pattern, so check the one difference directly: qwen35
    # counts combining marks (here Devanagari vowel signs and virama, category M) as part of a word.
    qwen2 = GGUFTokenizer(_read_meta(FIXTURES / "qwen2moe-tiny" / "model-f32.gguf"))
    text = "नमस्ते दुनिया, I'm"
    assert tiny.split_words(text) == ["नमस्ते", " दुनिया", ",", " I", "'m"]
    assert qwen2.split_words(text) == ["नमस", "्त", "े", " द", "ुन", "िय", "ा,", " I", "'m"]


def test_unknown_pre_tokenizer(tiny_meta: dict[str, Any]) -> None:
    with pytest.raises(UserError, match=r"'qwen7'.*deepseek-r1-qwen, qwen2, qwen35"):
        GGUFTokenizer({**tiny_meta, "tokenizer.ggml.pre": "qwen7"})
    missing = {k: v for k, v in tiny_meta.items() if k != "tokenizer.ggml.pre"}
    with pytest.raises(UserError, match="is missing"):
        GGUFTokenizer(missing)
    assert set(PRE_TOKENIZER_PATTERNS) >= {"qwen2", "qwen35"}


def test_unsupported_tokenizer_model(tiny_meta: dict[str, Any]) -> None:
    with pytest.raises(UserError, match="'llama' is not supported"):
        GGUFTokenizer({**tiny_meta, "tokenizer.ggml.model": "llama"})


# --- chat template ------------------------------------------------------------------------------------


def test_multi_turn_chat(tiny: GGUFTokenizer) -> None:
    template = ChatTemplate.from_tokenizer(tiny)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "<think>\nIt is a sequence.\n</think>\n\nAn ordered collection."},
        {"role": "user", "content": "And a tuple?"},
    ]
    text = template.render(messages, add_generation_prompt=True)
    # ChatML turns; reasoning of an assistant turn before the last user query is dropped from history.
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is a list?<|im_end|>\n"
        "<|im_start|>assistant\nAn ordered collection.<|im_end|>\n"
        "<|im_start|>user\nAnd a tuple?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    ids = tiny.encode(text)
    assert ids.count(761) == 5 and ids.count(762) == 4 and ids[-2:] == [763, 198]

    no_think = template.render(messages, add_generation_prompt=True, enable_thinking=False)
    assert no_think == text + "\n</think>\n\n"
    # An assistant turn after the last user query keeps its reasoning block.
    last = template.render(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}],
        add_generation_prompt=False,
    )
    assert (
        last == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\na<|im_end|>\n"
    )


def test_template_helpers(tiny: GGUFTokenizer) -> None:
    template = ChatTemplate.from_tokenizer(tiny)
    tools = [{"type": "function", "function": {"name": "f", "description": "<a & b> é"}}]
    text = template.render([{"role": "user", "content": "hi"}], tools=tools)
    # tojson keeps <, &, and non-ASCII text as is (jinja2's own filter would HTML-escape them).
    assert '\n{"type": "function", "function": {"name": "f", "description": "<a & b> é"}}\n' in text
    with pytest.raises(TemplateRaised, match="No user query found"):
        template.render([{"role": "system", "content": "alone"}])
    with pytest.raises(UserError, match="at least one message"):
        template.render([])


def test_template_runs_sandboxed() -> None:
    with pytest.raises(UserError, match="failed on this conversation"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(UserError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_chatml_fallback(caplog: pytest.LogCaptureFixture, tiny: GGUFTokenizer) -> None:
    with caplog.at_level(logging.WARNING, logger="swarm.coordinator.text.chat"):
        template = ChatTemplate.from_metadata({})
    assert template.is_fallback and template.source == CHATML_TEMPLATE
    assert "no tokenizer.chat_template" in caplog.text
    text = template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.encode(text).count(761) == 3
