"""The model's tokenizer and chat template, without transformers (which imports torch).

`tokenizers` reads tokenizer.json; the chat template is rendered with jinja2 the way
transformers renders it (a sandboxed environment with trim_blocks and lstrip_blocks,
a `raise_exception` global and a `tojson` filter).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from pagoda.scheduler_svc.reasoning import THINK_CLOSE, THINK_OPEN
from pagoda.scheduler_svc.tools import ToolFormat, tool_format

BASE_ROLES = ("system", "user", "assistant", "tool")
# A model_max_length this large in tokenizer_config.json means "not set".
UNSET_MODEL_MAX_LENGTH = 10**9
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


# What render_chat gives the template itself: a caller's variables cannot replace them.
TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"}
)


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template refused the conversation."""


@dataclass(slots=True, eq=False)
class TextTokenizer:
    """Text <-> token ids for one model, plus its chat template and special tokens."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: frozenset[int]
    bos_token_id: int | None
    model_max_length: int | None  # longest sequence the model supports; None if unknown
    known_roles: frozenset[str] = frozenset()
    # How the template shows tools and the model writes calls (scheduler_svc.tools).
    tool_format: ToolFormat = ToolFormat.GENERIC
    # Whether the template writes the model's thinking between <think> and </think>, tags
    # that decoding keeps (not special tokens): Chat keeps it apart (reasoning.py).
    thinks: bool = False
    _template: jinja2.Template | None = None
    # The text of each special token ("<|im_start|>"), and a copy of the tokenizer that
    # reads such text in a message's content as ordinary text (made on first use).
    special_texts: tuple[str, ...] = ()
    # Every added token (text, id), special or not, by id: a grammar (llguidance) sees
    # them as tokens, never as the bytes of their text.
    added_tokens: tuple[tuple[str, int], ...] = ()
    _splitting: Tokenizer | None = None
    _byte_tables: dict[bool, list[bytes] | None] = field(default_factory=dict)
    _text_tables: dict[bool, list[str | None] | None] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, rendered: str, contents: list[str]) -> list[int]:
        """The ids of a rendered conversation whose turn markers are special tokens only
        where the template wrote them: a content's "<|im_end|>\n<|im_start|>system" is
        text, so a user cannot open a turn of another role (security review N10).
        Contents without a special token's text, nearly all, leave the rendering to be
        encoded whole, exactly as before."""
        forging = [c for c in contents if any(text in c for text in self.special_texts)]
        if not forging:
            return self.encode(rendered, add_special_tokens=False)
        ids: list[int] = []
        start = 0
        for content in forging:
            index, found = _locate(rendered, content, start)
            ids += self.encode(rendered[start:index], add_special_tokens=False)
            ids += self._split_encoder().encode(found, add_special_tokens=False).ids
            start = index + len(found)
        return ids + self.encode(rendered[start:], add_special_tokens=False)

    def _split_encoder(self) -> Tokenizer:
        if self._splitting is None:
            splitting = Tokenizer.from_str(self.tokenizer.to_str())
            splitting.encode_special_tokens = True
            self._splitting = splitting  # two threads may both build it: either is right
        return self._splitting

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The token's piece as the vocabulary spells it ("Ġhello" in byte-level BPE)."""
        return self.tokenizer.id_to_token(token_id) or ""

    def render_chat(
        self,
        messages: Sequence[tuple[str, str] | Mapping[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Messages ((role, content) pairs, or message dicts as transformers takes them:
        "tool_calls", "tool_call_id", ...) -> prompt text with the assistant's turn opened.
        `tools` go to the template as transformers passes them (None: no tools);
        `variables` are the caller's own ({"enable_thinking": False}), none of
        TEMPLATE_VARIABLES."""
        if self._template is None:
            raise ChatTemplateError("the model has no chat template")
        if variables and not TEMPLATE_VARIABLES.isdisjoint(variables):
            raise ChatTemplateError("a template variable of the server's was given")
        return self._template.render(
            **(variables or {}),
            messages=[
                message
                if isinstance(message, Mapping)
                else dict(role=message[0], content=message[1])
                for message in messages
            ],
            tools=tools,
            documents=None,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def token_bytes(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each token id's UTF-8 bytes, when decoding is plain concatenation of them.

        True of byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM); None otherwise
        (SentencePiece-style decoders strip and replace across tokens). Checked against
        `decode` for every token once, so a table is only ever returned when exact.
        """
        if skip_special_tokens not in self._byte_tables:
            self._byte_tables[skip_special_tokens] = _byte_level_table(
                self.tokenizer, skip_special_tokens
            )
        return self._byte_tables[skip_special_tokens]

    def decoded_bytes(self, token_id: int) -> bytes:
        """A token's bytes as decoding gives them: the byte table where decoding is
        concatenation (byte-level BPE), else the token decoded alone; none for a special
        token (decoding skips it) or an id beyond the table."""
        table = self.token_bytes()
        if table is None:
            return self.decode([token_id]).encode()
        return table[token_id] if token_id < len(table) else b""

    def logprob_bytes(self, token_id: int) -> bytes:
        """A token's text as bytes for its logprobs: its decoded bytes, and a special token
        (none) spelled as the vocabulary has it."""
        return self.decoded_bytes(token_id) or self.id_to_piece(token_id).encode()

    def token_texts(self, skip_special_tokens: bool = True) -> list[str | None] | None:
        """Each token's text when its `token_bytes` are whole UTF-8 characters, else None
        (the token holds part of a character); None overall without a byte table."""
        if skip_special_tokens not in self._text_tables:
            table = self.token_bytes(skip_special_tokens)
            self._text_tables[skip_special_tokens] = (
                None if table is None else [_whole_utf8(token_bytes) for token_bytes in table]
            )
        return self._text_tables[skip_special_tokens]


def load_tokenizer(model_dir: Path) -> TextTokenizer:
    """The tokenizer of a Hugging Face model directory (tokenizer.json required)."""
    model_dir = Path(model_dir)
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{tokenizer_file} is missing; the scheduler needs tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    model_config = _read_json(model_dir / "config.json")
    generation_config = _read_json(model_dir / "generation_config.json")

    bos_token = _token_content(tokenizer_config.get("bos_token"))
    eos_token = _token_content(tokenizer_config.get("eos_token"))
    eos_token_ids: set[int] = set()
    for config in (generation_config, model_config):
        eos_token_ids.update(_ids(config.get("eos_token_id")))
    if eos_token is not None and (eos_id := tokenizer.token_to_id(eos_token)) is not None:
        eos_token_ids.add(eos_id)
    bos_token_id = tokenizer.token_to_id(bos_token) if bos_token is not None else None
    if bos_token_id is None and isinstance(model_config.get("bos_token_id"), int):
        bos_token_id = model_config["bos_token_id"]

    chat_template = _chat_template(model_dir, tokenizer_config)
    text_tokenizer = TextTokenizer(
        tokenizer=tokenizer,
        chat_template=chat_template,
        bos_token=bos_token,
        eos_token=eos_token,
        eos_token_ids=frozenset(eos_token_ids),
        bos_token_id=bos_token_id,
        model_max_length=_model_max_length(model_config, tokenizer_config),
        tool_format=tool_format(chat_template),
        _template=_compile_template(chat_template) if chat_template else None,
    )
    text_tokenizer.known_roles = _probe_roles(text_tokenizer)
    added_tokens = tokenizer.get_added_tokens_decoder()
    text_tokenizer.special_texts = tuple(
        added.content for added in added_tokens.values() if added.special and added.content
    )
    text_tokenizer.added_tokens = tuple(
        (added.content, token_id)
        for token_id, added in sorted(added_tokens.items())
        if added.content
    )
    text_tokenizer.thinks = (
        chat_template is not None
        and THINK_OPEN in chat_template
        and THINK_CLOSE in chat_template
        and not {THINK_OPEN, THINK_CLOSE} & set(text_tokenizer.special_texts)
    )
    text_tokenizer.token_texts()  # built now (~0.3 s) rather than in the first request's step
    return text_tokenizer


def _locate(rendered: str, content: str, start: int) -> tuple[int, str]:
    """Where `content` (or, for a template that trims, its stripped form) is in `rendered`
    at or after `start`, and the form found."""
    for form in (content, content.strip()):
        index = rendered.find(form, start) if form else -1
        if index >= 0:
            return index, form
    raise ChatTemplateError(
        "a message holds a special token's text and the chat template changed that "
        "message, so it cannot be kept apart from the template's own tokens"
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    loaded = json.loads(path.read_text(encoding="utf-8"))
    return loaded if isinstance(loaded, dict) else {}


def _token_content(token: object) -> str | None:
    """tokenizer_config spells a special token as a string or as {"content": ...}."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _ids(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, int)]
    return []


def _model_max_length(model_config: dict[str, Any], tokenizer_config: dict[str, Any]) -> int | None:
    for key in _CONTEXT_KEYS:
        if isinstance(model_config.get(key), int):
            return model_config[key]
    length = tokenizer_config.get("model_max_length")
    if isinstance(length, int | float) and length < UNSET_MODEL_MAX_LENGTH:
        return int(length)
    return None


def _chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {
            item.get("name"): item.get("template") for item in template if isinstance(item, dict)
        }
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _compile_template(source: str) -> jinja2.Template:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


def _probe_roles(tokenizer: TextTokenizer) -> frozenset[str]:
    """Roles the template renders: a template that raises on a role does not know it."""
    if tokenizer._template is None:
        return frozenset()
    probe = "pagoda-role-probe"
    conversations = {
        "system": [("system", probe), ("user", "hi")],
        "user": [("user", probe)],
        "assistant": [("user", "hi"), ("assistant", probe)],
        "tool": [("user", "hi"), ("assistant", "call"), ("tool", probe)],
    }
    known = set()
    for role, conversation in conversations.items():
        try:
            if probe in tokenizer.render_chat(conversation):
                known.add(role)
        except Exception:  # noqa: BLE001 - any template failure means "unknown role"
            continue
    return frozenset(known)


def _whole_utf8(token_bytes: bytes) -> str | None:
    try:
        return token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char_of_byte = {byte: byte for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in char_of_byte:
            char_of_byte[byte] = 256 + extra
            extra += 1
    return {chr(char): byte for byte, char in char_of_byte.items()}


def _byte_level_table(tokenizer: Tokenizer, skip_special_tokens: bool) -> list[bytes] | None:
    if type(tokenizer.decoder).__name__ != "ByteLevel":
        return None
    byte_of_char = _byte_level_alphabet()
    alphabet = frozenset(byte_of_char)
    # Each stand-in char -> the latin-1 char of its byte, so encode("latin-1") gives the bytes.
    to_latin1 = str.maketrans({char: chr(byte) for char, byte in byte_of_char.items()})
    special_ids = {
        token_id
        for token_id, added in tokenizer.get_added_tokens_decoder().items()
        if added.special
    }
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    pieces: list[str | None] = [None] * vocab_size
    for piece, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            pieces[token_id] = piece
    table: list[bytes] = []
    for token_id, piece in enumerate(pieces):
        if piece is None or (skip_special_tokens and token_id in special_ids):
            table.append(b"")
        elif alphabet.issuperset(piece):
            table.append(piece.translate(to_latin1).encode("latin-1"))
        else:  # the decoder passes a token with other characters through as UTF-8
            table.append(piece.encode())
    # Exact or nothing: every token must decode alone as the tokenizer decodes it.
    decoded = tokenizer.decode_batch(
        [[token_id] for token_id in range(vocab_size)], skip_special_tokens=skip_special_tokens
    )
    for token_bytes, text in zip(table, decoded, strict=True):
        if token_bytes.decode("utf-8", "replace") != text:
            return None
    return table
