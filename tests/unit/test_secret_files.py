"""Secret files (security review N12): key pairs are written 0600 from the first byte and
never over an existing pair; a loaded secret that others can read is warned about."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from pagoda.common import curve
from pagoda.scheduler_svc.auth import read_api_keys


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_a_key_pair_is_written_0600_and_never_over_an_existing_one(tmp_path, umask_022, capsys):
    directory = tmp_path / "keys"
    assert curve.main([str(directory), "scheduler"]) == 0
    public, secret = directory / "scheduler.key", directory / "scheduler.key_secret"
    assert mode_of(secret) == 0o600 and mode_of(public) == 0o644
    assert mode_of(directory) == 0o700
    pair = curve.load_key_pair(secret)
    assert curve.load_public_key(public) == pair.public
    before = secret.read_bytes()
    with pytest.raises(SystemExit):
        curve.main([str(directory), "scheduler"])
    assert "exists" in capsys.readouterr().err
    assert secret.read_bytes() == before


def test_a_directory_others_can_write_is_refused(tmp_path, capsys):
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(SystemExit):
        curve.main([str(directory), "worker"])
    assert "writable by others" in capsys.readouterr().err
    assert not list(directory.iterdir())


def test_secrets_readable_by_others_are_warned_about(tmp_path, caplog, umask_022):
    directory = tmp_path / "keys"
    curve.main([str(directory), "worker"])
    secret = directory / "worker.key_secret"
    api_keys = tmp_path / "api-keys"
    api_keys.write_text("key-a\n")
    with caplog.at_level(logging.WARNING):
        curve.load_key_pair(secret)
        read_api_keys(str(api_keys))  # 0644 under the umask
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "api_key_file" in warnings[0] and "0644" in warnings[0]
    secret.chmod(0o640)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        curve.load_key_pair(secret)
    assert "chmod 600" in caplog.text
