"""Incremental detokenization: token ids in, whole UTF-8 characters out.

`push` never returns half a character: bytes of a character split across tokens
(emoji, CJK, byte-fallback tokens) wait for the token that completes it. The
concatenated output equals `tokenizer.decode(all_ids)`.

Two strategies, picked per tokenizer:
- byte-level BPE: a table of each token's bytes and an incremental UTF-8 decoder,
  O(1) per token with no call into the tokenizer;
- anything else: decode a short window of recent tokens twice and emit the
  difference, so decoders that strip or merge across tokens stay exact.
"""

from __future__ import annotations

import codecs

from pagoda.scheduler_svc.tokenizer import TextTokenizer

REPLACEMENT_CHAR = "\ufffd"
# whole_texts while no text may be looked up: every index is beyond it.
NO_WHOLE_TEXTS: tuple[()] = ()


class IncrementalDetokenizer:
    """The text state of one request's generated tokens; not shared between requests."""

    __slots__ = (
        "_tokenizer",
        "_skip_special_tokens",
        "_table",
        "_texts",
        "whole_texts",
        "_utf8",
        "_window_ids",
        "_read_offset",
    )

    def __init__(
        self,
        tokenizer: TextTokenizer,
        skip_special_tokens: bool = True,
        use_byte_table: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._table = tokenizer.token_bytes(skip_special_tokens) if use_byte_table else None
        # Byte-table strategy: each token's text when its bytes are whole characters.
        self._texts = tokenizer.token_texts(skip_special_tokens) if self._table else None
        # The byte strategy's table while no character is partial, so a caller may look a
        # token's text up without a call (None entry, or an index beyond it: push it);
        # NO_WHOLE_TEXTS otherwise.
        self.whole_texts: list[str | None] | tuple[()] = self._texts or NO_WHOLE_TEXTS
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        # Window strategy: ids from the last emitted boundary's predecessor on; the first
        # `_read_offset` of them are already emitted and give the decoder its context.
        self._window_ids: list[int] = []
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """The text completed by this token ("" while a character is still partial)."""
        texts = self.whole_texts
        if token_id < len(texts):
            text = texts[token_id]
            if text is not None:
                return text  # the common case: whole characters, nothing pending
        if self._texts is None:
            return self._push_window(token_id)
        return self._push_bytes(token_id)

    def flush(self) -> str:
        """The end of the text: a character left incomplete becomes U+FFFD, as decode() does."""
        if self._texts is not None:
            self.whole_texts = self._texts
            return self._utf8.decode(b"", final=True)
        ids, read_offset = self._window_ids, self._read_offset
        if len(ids) == read_offset:
            return ""
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        emitted = decode(ids[:read_offset], skip) if read_offset else ""
        text = decode(ids, skip)
        self._window_ids, self._read_offset = [], 0
        return text[len(emitted) :]

    def _push_bytes(self, token_id: int) -> str:
        table = self._table
        token_bytes = table[token_id] if token_id < len(table) else b""
        text = self._utf8.decode(token_bytes)
        self.whole_texts = NO_WHOLE_TEXTS if self._utf8.getstate()[0] else self._texts
        return text

    def _push_window(self, token_id: int) -> str:
        ids = self._window_ids
        ids.append(token_id)
        read_offset = self._read_offset
        decode = self._tokenizer.decode
        skip = self._skip_special_tokens
        emitted = decode(ids[:read_offset], skip) if read_offset else ""
        text = decode(ids, skip)
        if len(text) <= len(emitted) or text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or a character still waits for its last bytes
        # Keep the tokens since the previous boundary as context for the next window.
        self._window_ids = ids[read_offset:] if read_offset else ids
        self._read_offset = len(self._window_ids)
        return text[len(emitted) :]
