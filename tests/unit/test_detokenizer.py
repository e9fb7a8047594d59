"""Incremental detokenization: whole characters only, and the same text as decode()."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pagoda.scheduler_svc.detokenizer import IncrementalDetokenizer
from pagoda.scheduler_svc.tokenizer import TextTokenizer, load_tokenizer
from tests.unit.conftest import apply_scripts, make_geometry, make_request, make_scheduler

TEXTS = [
    "Hello, world! Plain ASCII.",
    "Emoji: 😀🎉 and a family 👨‍👩‍👧 with joiners, then 🚀.",
    "日本語のテキスト、中文也可以。한국어도.",
    "Accents: ça va, naïve, Ångström, ñandú.",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
]


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir) -> TextTokenizer:
    return load_tokenizer(default_model_dir)


def stream(tokenizer: TextTokenizer, ids: list[int], use_byte_table: bool) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, use_byte_table=use_byte_table)
    return [detokenizer.push(token_id) for token_id in ids] + [detokenizer.flush()]


@pytest.mark.parametrize("use_byte_table", [True, False], ids=["byte-table", "window"])
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_add_up_to_decode(default_tokenizer, text, use_byte_table):
    ids = default_tokenizer.encode(text)
    pieces = stream(default_tokenizer, ids, use_byte_table)
    assert "".join(pieces) == default_tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("use_byte_table", [True, False], ids=["byte-table", "window"])
def test_a_character_split_across_tokens_waits_for_its_last_byte(default_tokenizer, use_byte_table):
    ids = default_tokenizer.encode("😀")
    assert len(ids) > 1  # byte-level BPE splits this emoji's four bytes
    assert stream(default_tokenizer, ids, use_byte_table)[:-1] == [""] * (len(ids) - 1) + ["😀"]


@pytest.mark.parametrize("use_byte_table", [True, False], ids=["byte-table", "window"])
def test_special_tokens_are_skipped(default_tokenizer, use_byte_table):
    ids = [1, *default_tokenizer.encode("hi"), 2]
    assert "".join(stream(default_tokenizer, ids, use_byte_table)) == "hi"


@pytest.mark.parametrize("use_byte_table", [True, False], ids=["byte-table", "window"])
def test_any_token_sequence_matches_decode_even_with_broken_bytes(
    default_tokenizer, use_byte_table
):
    rng = random.Random(7)
    for _ in range(100):
        ids = [rng.randrange(default_tokenizer.vocab_size) for _ in range(rng.randrange(1, 24))]
        pieces = stream(default_tokenizer, ids, use_byte_table)
        assert "".join(pieces) == default_tokenizer.decode(ids)


def sentencepiece_style_tokenizer() -> TextTokenizer:
    """A Llama-2-style tokenizer: ▁ for spaces, <0xNN> byte-fallback tokens, a decoder
    that strips the first space: not plain concatenation, so the window strategy runs."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for word in ("▁Hello", "▁world", "▁", "!", "é", "▁caf"):
        vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return TextTokenizer(
        tokenizer=tokenizer,
        chat_template=None,
        bos_token="<s>",
        eos_token="</s>",
        eos_token_ids=frozenset({2}),
        bos_token_id=1,
        model_max_length=None,
    )


def test_byte_fallback_tokens_and_a_stripping_decoder():
    tokenizer = sentencepiece_style_tokenizer()
    assert tokenizer.token_bytes() is None
    ids = tokenizer.encode("Hello world! café 日本", add_special_tokens=False)
    byte_tokens = [i for i in ids if tokenizer.id_to_piece(i).startswith("<0x")]
    assert len(byte_tokens) >= 6  # 日本 arrive as six <0xNN> bytes
    pieces = stream(tokenizer, ids, use_byte_table=True)
    assert "".join(pieces) == tokenizer.decode(ids) == "Hello world! café 日本"
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_dangling_partial_character_becomes_a_replacement_at_the_end(default_tokenizer):
    ids = default_tokenizer.encode("😀")[:1]
    for use_byte_table in (True, False):
        *pushed, flushed = stream(default_tokenizer, ids, use_byte_table)
        assert pushed == [""] and flushed.endswith("\ufffd")
        assert flushed == default_tokenizer.decode(ids)


def test_looking_texts_up_in_whole_texts_is_the_same_as_pushing(default_tokenizer):
    """The output processor reads whole_texts[token_id] itself and calls push() only
    when that is None or beyond the table: the pieces must be the same, broken bytes
    included."""
    rng = random.Random(11)
    for _ in range(200):
        ids = [rng.randrange(default_tokenizer.vocab_size) for _ in range(rng.randrange(1, 24))]
        ids += default_tokenizer.encode("😀 日本")  # partial characters on the way
        detokenizer = IncrementalDetokenizer(default_tokenizer)
        pieces = []
        for token_id in ids:
            table = detokenizer.whole_texts
            text = table[token_id] if token_id < len(table) else None
            pieces.append(text if text is not None else detokenizer.push(token_id))
        pieces.append(detokenizer.flush())
        assert "".join(pieces) == default_tokenizer.decode(ids)
        assert pieces == stream(default_tokenizer, ids, use_byte_table=True)
    assert IncrementalDetokenizer(default_tokenizer, use_byte_table=False).whole_texts == ()


def test_the_scheduler_streams_what_decode_gives_with_partial_characters(default_tokenizer):
    """The output processor looks most texts up itself: several requests decoding together,
    each through broken bytes, emoji and CJK split across tokens, must each stream decode()
    of its tokens."""
    rng = random.Random(5)
    scripts = []
    for _ in range(4):
        ids = default_tokenizer.encode("😀 ok 日本 ")
        ids += [rng.randrange(default_tokenizer.vocab_size) for _ in range(40)]
        ids += default_tokenizer.encode("👨‍👩‍👧 end") + ids[:1]
        scripts.append(ids)
    geometry = make_geometry(
        num_kv_blocks=128,
        eos_token_ids=default_tokenizer.eos_token_ids,
        vocab_size=default_tokenizer.vocab_size,
    )
    scheduler = make_scheduler(geometry, lambda: IncrementalDetokenizer(default_tokenizer))
    for index, ids in enumerate(scripts):
        # The first prompt token names the request in the plan.
        prompt = [100 + index, 7, 7]
        scheduler.add(
            make_request(f"r{index}", prompt, max_new_tokens=len(ids), ignore_eos=True), 0.0
        )
    events = apply_scripts(scheduler, scripts)
    for index, ids in enumerate(scripts):
        assert "".join(event.text for event in events[f"r{index}"]) == default_tokenizer.decode(ids)
