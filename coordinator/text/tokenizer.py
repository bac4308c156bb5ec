"""The model's tokenizer, built from a GGUF's own metadata (no tokenizer.json, no download).

GGUF files of the Qwen MoE families carry a byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`): the
token strings in GPT-2's byte-to-unicode alphabet, the merge list, a type per token, and the name of the
pre-tokenizer (`tokenizer.ggml.pre`) that splits text into words before BPE. Encoding runs on the
`tokenizers` library (Rust); decoding maps ids to their bytes through a table built here, so that whole
decodes and the streaming detokenizer agree byte for byte.

Behaviour follows llama.cpp (the reference engine) where it differs from transformers:
- no NFC normalization (transformers' Qwen tokenizer.json applies NFC; llama.cpp does not), so
  `decode(encode(s)) == s` for any string;
- CONTROL tokens (`<|im_start|>`, ...) are matched whole in text only when `parse_special` is on;
  USER_DEFINED tokens (`<think>`, ...) are matched always;
- CONTROL and USER_DEFINED tokens decode to their text as is, NORMAL tokens through the byte alphabet,
  UNUSED tokens (the converter's `[PAD<i>]` fillers) to nothing.
"""

from __future__ import annotations

import codecs
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from gguf import Keys, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from swarm.sharding.errors import UserError

log = logging.getLogger(__name__)

# The split patterns of the pre-tokenizers, as written in the models' tokenizer.json (llama.cpp's
# llama-vocab.cpp spells the same patterns with `'[sS]` instead of `(?i:'s)` for its own regex engine).
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 adds combining marks (\p{M}) to words, so "à" written as a + U+0300 stays one word.
_QWEN35_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> split pattern. Qwen1.5-MoE (qwen2moe), Qwen3 MoE and Qwen3-Next GGUFs carry
# `qwen2` (their tokenizer hashes to Qwen2's in llama.cpp's converter); Qwen3.5/3.6 carry `qwen35`.
# `deepseek-r1-qwen` is the DeepSeek-R1 distill of Qwen2.5: same vocabulary family, same pattern.
PRE_TOKENIZER_PATTERNS: dict[str, str] = {
    "qwen2": _QWEN2_PATTERN,
    "deepseek-r1-qwen": _QWEN2_PATTERN,
    "qwen35": _QWEN35_PATTERN,
}

# Texts of end-of-generation tokens besides the declared eos/eot/eom (llama.cpp keeps a similar list):
# Qwen's generation config stops on both <|im_end|> and <|endoftext|>, but a GGUF declares only one eos.
_EOG_TEXTS = frozenset(
    {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>"}
)


def _byte_alphabet() -> dict[int, int]:
    """GPT-2's byte-level alphabet inverted: code point of the stand-in character -> the byte it encodes.

    Printable bytes stand for themselves; the others (controls, space, 0x7f-0xa0, 0xad) are shifted to
    U+0100 upwards in byte order, so every byte has a visible, non-space character.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    inverse = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in inverse:
            inverse[256 + shifted] = b
            shifted += 1
    return inverse


# str.translate table: byte-alphabet character -> the latin-1 character of its byte, so that
# `token.translate(_TO_LATIN1).encode("latin-1")` is the token's bytes, done in C for the whole vocab.
_TO_LATIN1: dict[int, int] = _byte_alphabet()


def _meta_int(meta: Mapping[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


class GGUFTokenizer:
    """Byte-level BPE tokenizer of a GGUF (`meta` = `swarm.sharding.gguf_io.read_metadata(...)`)."""

    def __init__(self, meta: Mapping[str, Any]) -> None:
        model = meta.get(Keys.Tokenizer.MODEL)
        if model != "gpt2":
            raise UserError(
                f"tokenizer {Keys.Tokenizer.MODEL} = {model!r} is not supported: swarm reads byte-level BPE "
                "vocabularies ('gpt2', as in every Qwen GGUF); use a GGUF converted from a Qwen MoE model"
            )
        pre = meta.get(Keys.Tokenizer.PRE)
        if pre not in PRE_TOKENIZER_PATTERNS:
            known = ", ".join(sorted(PRE_TOKENIZER_PATTERNS))
            what = "is missing" if pre is None else f"= {pre!r} is unknown"
            raise UserError(
                f"tokenizer pre-tokenizer {Keys.Tokenizer.PRE} {what}; swarm knows: {known}. "
                "Re-convert the model with a recent llama.cpp convert_hf_to_gguf.py"
            )
        tokens: list[str] = list(meta.get(Keys.Tokenizer.LIST) or [])
        merges: list[str] = list(meta.get(Keys.Tokenizer.MERGES) or [])
        if not tokens or not merges:
            raise UserError(
                f"the GGUF has no tokenizer vocabulary ({Keys.Tokenizer.LIST} / {Keys.Tokenizer.MERGES}); "
                "use a GGUF that includes its tokenizer"
            )
        types: list[int] = list(meta.get(Keys.Tokenizer.TOKEN_TYPE) or [TokenType.NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise UserError(
                f"the GGUF has {len(tokens)} tokens but {len(types)} token types; the file is damaged, "
                "convert it again"
            )

        self.pre: str = pre
        self.tokens: list[str] = tokens
        self.token_types: list[int] = [int(t) for t in types]
        self.bos_id: int | None = _meta_int(meta, Keys.Tokenizer.BOS_ID)
        self.eos_id: int | None = _meta_int(meta, Keys.Tokenizer.EOS_ID)
        self.pad_id: int | None = _meta_int(meta, Keys.Tokenizer.PAD_ID)
        # llama.cpp's default for BPE vocabularies is no BOS unless the file asks for one.
        self.add_bos: bool = bool(meta.get(Keys.Tokenizer.ADD_BOS, False)) and self.bos_id is not None
        self.chat_template: str | None = meta.get(Keys.Tokenizer.CHAT_TEMPLATE)

        control = int(TokenType.CONTROL)
        user_defined = int(TokenType.USER_DEFINED)
        self.control_ids: frozenset[int] = frozenset(
            i for i, t in enumerate(self.token_types) if t == control
        )
        self.user_defined_ids: frozenset[int] = frozenset(
            i for i, t in enumerate(self.token_types) if t == user_defined
        )

        eos = {
            i
            for i in (
                self.eos_id,
                _meta_int(meta, Keys.Tokenizer.EOT_ID),
                _meta_int(meta, Keys.Tokenizer.EOM_ID),
            )
            if i is not None and 0 <= i < len(tokens)
        }
        eos.update(i for i in self.control_ids | self.user_defined_ids if tokens[i] in _EOG_TEXTS)
        self.eos_ids: frozenset[int] = frozenset(eos)

        self._tokenizer = self._build(tokens, merges, PRE_TOKENIZER_PATTERNS[pre])
        # `encode_special_tokens` is tokenizer-wide state; the lock keeps concurrent encodes with different
        # parse_special settings from seeing each other's.
        self._lock = threading.Lock()
        self._pieces: list[bytes] = _piece_table(tokens, self.token_types)

    def _build(self, tokens: list[str], merges: list[str], pattern: str) -> Tokenizer:
        # Every token, special ones included, goes into the BPE vocabulary so that the added tokens below
        # keep their GGUF ids (tokenizers reuses an existing id for an added token's text).
        vocab: dict[str, int] = {}
        for i, text in enumerate(tokens):
            if vocab.setdefault(text, i) != i:
                log.warning("token %d %r repeats token %d; encoding uses the first", i, text, vocab[text])
        pairs: list[tuple[str, str]] = []
        for rank, merge in enumerate(merges):
            left, sep, right = merge.partition(" ")
            if not sep:
                raise UserError(f"tokenizer merge {rank} {merge!r} is not 'left right'; the GGUF is damaged")
            pairs.append((left, right))

        tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        control = int(TokenType.CONTROL)
        user_defined = int(TokenType.USER_DEFINED)
        special = [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(self.token_types)
            if t == control and tokens[i]
        ]
        plain = [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(self.token_types)
            if t == user_defined and tokens[i]
        ]
        tok.add_special_tokens(special)
        tok.add_tokens(plain)
        return tok

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, parse_special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. parse_special: match CONTROL tokens written in the text (chat markup).

        add_bos: prepend BOS; None = as the GGUF says (`tokenizer.ggml.add_bos_token`, false for Qwen).
        """
        with self._lock:
            self._tokenizer.encode_special_tokens = not parse_special
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def split_words(self, text: str) -> list[str]:
        """The pre-tokenizer's split of `text` into the words BPE then encodes one by one (no special tokens)."""
        return [text[start:end] for _, (start, end) in self._tokenizer.pre_tokenizer.pre_tokenize_str(text)]

    def token_bytes(self, token_id: int, skip_control: bool = False) -> bytes:
        """The bytes token `token_id` stands for (possibly part of a UTF-8 character)."""
        if not 0 <= token_id < len(self._pieces):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {len(self._pieces)} tokens")
        if skip_control and token_id in self.control_ids:
            return b""
        return self._pieces[token_id]

    def decode(self, ids: Iterable[int], skip_control: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a cut multibyte character) becomes U+FFFD.

        skip_control: leave out CONTROL tokens (<|im_start|>, <|im_end|>, ...); USER_DEFINED ones such as
        <think> are content and always shown.
        """
        data = b"".join(self.token_bytes(i, skip_control) for i in ids)
        return data.decode("utf-8", errors="replace")

    def stream(self, skip_control: bool = False) -> StreamDetokenizer:
        """A detokenizer for tokens arriving one at a time (see StreamDetokenizer)."""
        return StreamDetokenizer(self, skip_control)


def _piece_table(tokens: Sequence[str], token_types: Sequence[int]) -> list[bytes]:
    """The bytes each token decodes to (40 ms for 151k tokens: the byte alphabet is undone in C)."""
    normal_like = (int(TokenType.NORMAL), int(TokenType.BYTE))
    literal = (int(TokenType.CONTROL), int(TokenType.USER_DEFINED))
    pieces: list[bytes] = []
    for text, ttype in zip(tokens, token_types, strict=True):
        if ttype in normal_like:
            try:
                pieces.append(text.translate(_TO_LATIN1).encode("latin-1"))
            except UnicodeEncodeError:
                # Not in the byte alphabet: a hand-made token; take its text literally.
                pieces.append(text.encode("utf-8"))
        elif ttype in literal:
            pieces.append(text.encode("utf-8"))
        else:
            pieces.append(b"")  # UNUSED / UNKNOWN: no text, as in llama.cpp
    return pieces


class StreamDetokenizer:
    """Turns tokens into text as they arrive, holding back an incomplete UTF-8 character.

    A character split over several tokens (CJK, emoji) is emitted once its last byte arrives, so the
    concatenation of everything `push` and `flush` return equals `decode` of all the tokens.
    """

    def __init__(self, tokenizer: GGUFTokenizer, skip_control: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_control = skip_control
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token ('' while a multibyte character is still incomplete)."""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id, self._skip_control), final=False)

    def push_many(self, ids: Sequence[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (an unfinished character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)

    def iter_text(self, ids: Iterable[int]) -> Iterator[str]:
        """Non-empty text pieces for a stream of ids, ending with the flushed remainder."""
        for i in ids:
            text = self.push(i)
            if text:
                yield text
        tail = self.flush()
        if tail:
            yield tail
