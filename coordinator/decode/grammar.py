"""Structured output: a grammar held over an answer's tokens by a token mask, and the tokens it forces as drafts.

The grammar engine is llguidance (docs/ARCHITECTURE.md, the decode room, says why): a grammar (JSON schema,
Lark with embedded `%json{}` schemas, a regex) is compiled in about a millisecond against the model's whole
vocabulary, built once per tokenizer from the GGUF's own token bytes (`GrammarVocab`), and its mask for one
token costs tens of microseconds, with no per-grammar pass over the vocabulary.

A request's `Grammar` is two of the decode core's hooks at once:
- a LogitsProcessor (decode/sampling.py): every token the grammar forbids at a position gets -inf. Where the
  grammar forces bytes (a JSON key, the punctuation between fields) only the first of their canonical tokens
  (llguidance's fast-forward tokens) is left, so the tokens the model would read there are the ones its
  tokenizer makes; where the grammar is complete only EOS is left; where it leaves no token at all (a dead
  end) EOS is forced and `ended_by` says so afterwards, so the answer ends instead of hanging.
- a DraftSource (decode/core.py, as `forced`): the fast-forward tokens after the answer so far, which the
  mask makes the only choice at their positions, so a checking window accepts them all (a JSON skeleton
  costs no extra passes).
Both are functions of the tokens given (the answer so far): the matcher follows them, rolling back to the
common prefix of what it last saw, so a checking window's rows and a redo after a caught node get exactly
the mask of their prefix, and the text is the same with drafts and without.

Dimension letters: V vocabulary.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from swarm.coordinator.text.tokenizer import GGUFTokenizer

# How JSON is laid out where a grammar leaves it open: Python's json.dumps separators and no free whitespace,
# so the layout is forced (drafts) and a model cannot spend its answer on blank space.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The finish reason of an answer that the grammar left no token to go on with.
DEAD_END = "grammar"


class GrammarError(ValueError):
    """A grammar (or schema) the engine cannot compile; the message says why."""


class GrammarVocab:
    """llguidance's view of a GGUF vocabulary: every token's bytes (CONTROL tokens marked special, so that no
    text grammar produces them), its EOS tokens, and the GGUF tokenizer for the bytes a grammar forces.
    Building it walks the whole vocabulary (about half a second for 152k tokens): `of` keeps one per tokenizer."""

    _built: weakref.WeakKeyDictionary[GGUFTokenizer, GrammarVocab] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.size = tokenizer.vocab_size
        self.eos = sorted(tokenizer.eos_ids)
        if not self.eos:
            raise GrammarError(
                "the model's vocabulary declares no end-of-generation token: no grammar can end"
            )
        self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(TokenizerSource(tokenizer)), eos_token=self.eos)

    @classmethod
    def of(cls, tokenizer: GGUFTokenizer) -> GrammarVocab:
        with cls._lock:
            vocab = cls._built.get(tokenizer)
            if vocab is None:
                vocab = cls._built[tokenizer] = cls(tokenizer)
            return vocab

    def compile(self, grammar: str) -> str:
        """A grammar checked against this vocabulary (GrammarError naming what is wrong)."""
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll)
        if error:
            raise GrammarError(
                error.strip().splitlines()[0] if error.strip() else "the grammar does not compile"
            )
        return grammar


class TokenizerSource:
    """What llguidance.TokenizerWrapper reads off a tokenizer (bench/agents.py grows its tokens)."""

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self.tokenizer = tokenizer
        control = tokenizer.control_ids
        self.tokens = [
            b"\xff" + tokenizer.token_bytes(i) if i in control else tokenizer.token_bytes(i)
            for i in range(tokenizer.vocab_size)
        ]
        self.eos_token_id = min(tokenizer.eos_ids) if tokenizer.eos_ids else 0
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(control)

    def __call__(self, text: bytes | str) -> list[int]:
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self.tokenizer.encode(s, parse_special=False, add_bos=False)


def json_schema_lark(schema: Any) -> str:
    """The Lark body of a JSON schema's values (a GrammarError for what is not a schema)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema is an object (or true)")
    with_layout = {**schema, "x-guidance": {**JSON_LAYOUT, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(with_layout)


def answer_grammar(value_lark: str, thinking: bool = False) -> str:
    """A Lark grammar for an answer that is `value_lark` (after free thinking closed by </think>, where the
    prompt leaves the answer inside a thinking block: Qwen3's and Qwen3.5's generation prompt opens one)."""
    if not thinking:
        return f"start: {value_lark}\n"
    return f'start: think /[ \\t\\n]*/ {value_lark}\nthink[suffix="</think>"]: /(.|\\n)*/\n'


def json_grammar(schema: Any, thinking: bool = False) -> str:
    return answer_grammar(json_schema_lark(schema), thinking)


def in_thinking(text: str) -> bool:
    """Whether a prompt's text leaves the answer inside an open thinking block."""
    return text.rfind("<think>") > text.rfind("</think>")


class Grammar:
    """One answer held to a grammar (see the module's docstring): the answer starts at token `start` of the
    sequence (the prompt's length). Calls come from the engine thread; the lock keeps a stray caller safe."""

    def __init__(self, vocab: GrammarVocab, grammar: str, start: int) -> None:
        self.vocab, self.start = vocab, start
        self.matcher = llguidance.LLMatcher(vocab.ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error().strip().splitlines()[0])
        self.seen: list[int] = []  # the answer tokens the matcher has consumed
        self._lock = threading.Lock()
        self._bias = np.empty((0, 8), dtype=np.float32)  # a bias for each bit of llguidance's mask
        self._out = np.empty(0, dtype=np.float32)

    # --- following the answer -------------------------------------------------------------------------------

    def _follow(self, answer: Sequence[int]) -> bool:
        """The matcher brought to the state after `answer`; False where the answer leaves the grammar."""
        seen = self.seen
        common = 0
        limit = min(len(seen), len(answer))
        while common < limit and seen[common] == answer[common]:
            common += 1
        if common < len(seen):
            self.matcher.rollback(len(seen) - common)
            del seen[common:]
        rest = list(answer[common:])
        if rest:
            ok = self.matcher.validate_tokens(rest)
            if ok:
                self.matcher.consume_tokens(rest[:ok])
                seen.extend(rest[:ok])
            if ok < len(rest):
                return False
        return True

    # --- the LogitsProcessor ----------------------------------------------------------------------------------

    def __call__(self, logits: torch.Tensor, position: int, before: Sequence[int]) -> torch.Tensor:
        """logits [V] of the token at `position` -> those the grammar allows there (the rest -inf)."""
        with self._lock:
            alive = self._follow(before[self.start : position])
            forced = self.matcher.compute_ff_tokens() if alive else []
            if forced:
                return self._only(logits, forced[0])
            mask = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8) if alive else None
            if mask is None or not mask.any():
                return self._only(logits, self.vocab.eos[0])
            if len(self._bias) != len(mask):
                self._bias = np.empty((len(mask), 8), dtype=np.float32)
            np.take(_BYTE_BIAS, mask, axis=0, out=self._bias)
            row = logits.detach().float().cpu().numpy()
            out = self._buffer(row)
            n = min(len(out), self._bias.size)
            np.add(row[:n], self._bias.reshape(-1)[:n], out=out[:n])
            out[n:] = -np.inf
            return torch.from_numpy(out)

    def _buffer(self, row: np.ndarray) -> np.ndarray:
        """The grammar's own float32 row, as long as `row` (numpy: one thread, whatever torch's pool is doing;
        reused, so a row returned is good until the next call)."""
        if self._out.shape != row.shape:
            self._out = np.empty(row.shape, dtype=np.float32)
        return self._out

    def _only(self, logits: torch.Tensor, token: int) -> torch.Tensor:
        """A row in which `token` is the only choice."""
        row = logits.detach().float().cpu().numpy()
        keep = row[token] if np.isfinite(row[token]) else 0.0
        out = self._buffer(row)
        out.fill(-np.inf)
        out[token] = keep
        return torch.from_numpy(out)

    # --- the DraftSource -------------------------------------------------------------------------------------

    def forced(self, tokens: Sequence[int], seq: Any = None) -> tuple[int, ...]:
        """The tokens the grammar forces after `tokens` (the sequence so far), as drafts known to be right."""
        with self._lock:
            if not self._follow(tokens[self.start :]):
                return ()
            return tuple(self.matcher.compute_ff_tokens())

    # --- after the answer ------------------------------------------------------------------------------------

    def ended_by(self, answer: Sequence[int]) -> str | None:
        """DEAD_END where the answer ended (EOS) before the grammar was complete: the grammar left no token
        to go on with, so EOS was the only choice (llguidance's mask, or this one where the answer had left
        the grammar); else None."""
        with self._lock:
            body = list(answer)
            if not body or body[-1] not in self.vocab.eos:
                return None  # ended by its length or a stop string, not by the grammar
            body.pop()
            return None if self._follow(body) and self.matcher.is_accepting() else DEAD_END


# A byte of llguidance's mask -> the bias of its 8 tokens (0 allowed, -inf not), lowest bit first.
_BYTE_BIAS = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool),
    0.0,
    -np.inf,
).astype(np.float32)
