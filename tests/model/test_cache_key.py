"""The converted-model cache is keyed by the GGUF's bytes: two checkouts share one copy.

Nothing here converts a real model: a converted directory is faked by a config.json in
the directory the key names, and `convert_gguf` is replaced by one that fails the test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagoda.gpu_worker import model_loader
from pagoda.gpu_worker.model_loader import ModelNotFoundError, resolve_model_dir


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "pagoda" / "models"


@pytest.fixture
def hash_calls(monkeypatch) -> list[Path]:
    """Every file `gguf_digest` reads in full, in order."""
    calls: list[Path] = []
    real_hash_file = model_loader._hash_file

    def counting(path: Path) -> str:
        calls.append(path)
        return real_hash_file(path)

    monkeypatch.setattr(model_loader, "_hash_file", counting)
    return calls


@pytest.fixture
def no_conversion(monkeypatch) -> None:
    def refuse(gguf: Path, target: Path) -> None:
        raise AssertionError(f"converted {gguf} again into {target}")

    monkeypatch.setattr(model_loader, "convert_gguf", refuse)


def write_gguf(path: Path, payload: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + payload)
    return path


def fake_conversion(gguf: Path) -> Path:
    """What convert_gguf leaves behind, as far as the cache lookup cares."""
    target = model_loader._gguf_cache_dir(gguf)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    return target


def test_two_checkouts_with_the_same_file_share_one_converted_copy(tmp_path, no_conversion):
    first = write_gguf(tmp_path / "checkout-a/.venv/model.gguf", b"weights" * 1000)
    # Another checkout, another venv, even another file name: the same bytes.
    second = write_gguf(tmp_path / "checkout-b/venv/renamed.gguf", b"weights" * 1000)
    converted = fake_conversion(first)

    assert resolve_model_dir(str(second), provision=False).path == converted
    assert resolve_model_dir(str(first), provision=False).path == converted


def test_different_bytes_get_a_different_directory(tmp_path, no_conversion):
    first = write_gguf(tmp_path / "a/model.gguf", b"weights" * 1000)
    other = write_gguf(tmp_path / "b/model.gguf", b"weighty" * 1000)
    fake_conversion(first)

    assert model_loader._gguf_cache_dir(other) != model_loader._gguf_cache_dir(first)
    with pytest.raises(ModelNotFoundError, match="not converted yet"):
        resolve_model_dir(str(other), provision=False)


def test_an_unchanged_file_is_hashed_once_across_starts(tmp_path, hash_calls):
    gguf = write_gguf(tmp_path / "model.gguf", b"weights" * 1000)

    digests = {model_loader.gguf_digest(gguf) for _ in range(3)}

    assert len(digests) == 1
    assert hash_calls == [gguf]  # the memo beside the cache answered the later starts


def test_an_edit_that_keeps_size_and_mtime_is_hashed_again(tmp_path, hash_calls):
    gguf = write_gguf(tmp_path / "model.gguf", b"weights" * 1000)
    before = model_loader.gguf_digest(gguf)
    stat = gguf.stat()
    # Same size, mtime put back (as cp -p or touch -r would): only the ctime tells.
    write_gguf(gguf, b"weighty" * 1000)
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert gguf.stat().st_size == stat.st_size

    after = model_loader.gguf_digest(gguf)

    assert after != before
    assert hash_calls == [gguf, gguf]


def test_a_moved_file_is_hashed_again_and_keeps_its_key(tmp_path, hash_calls):
    gguf = write_gguf(tmp_path / "a/model.gguf", b"weights" * 1000)
    before = model_loader.gguf_digest(gguf)
    moved = tmp_path / "b/model.gguf"
    moved.parent.mkdir()
    gguf.rename(moved)

    assert model_loader.gguf_digest(moved) == before
    assert hash_calls == [gguf, moved]


def test_a_cache_that_cannot_keep_the_memo_still_resolves(tmp_path, private_cache, hash_calls):
    gguf = write_gguf(tmp_path / "model.gguf", b"weights" * 1000)
    # A file where the memo directory should be: writing the memo fails even for root.
    private_cache.mkdir(parents=True)
    (private_cache / model_loader.GGUF_DIGESTS_DIR).write_text("")

    digests = {model_loader.gguf_digest(gguf) for _ in range(2)}

    assert len(digests) == 1
    assert hash_calls == [gguf, gguf]  # no memo could be written: hashed each time


def test_a_corrupt_memo_is_replaced(tmp_path, private_cache, hash_calls):
    gguf = write_gguf(tmp_path / "model.gguf", b"weights" * 1000)
    digest = model_loader.gguf_digest(gguf)
    (memo,) = (private_cache / model_loader.GGUF_DIGESTS_DIR).iterdir()
    memo.write_text("{not json")

    assert model_loader.gguf_digest(gguf) == digest
    assert model_loader.gguf_digest(gguf) == digest
    assert hash_calls == [gguf, gguf]
