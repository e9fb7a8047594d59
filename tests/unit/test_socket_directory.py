"""The directory of an ipc:// worker socket is private, or both processes refuse it
(security review N13): another user who planted /tmp/pagoda-$UID could replace the socket."""

from __future__ import annotations

import os

import pytest

from pagoda.common.transport import UnsafeSocketDirectory, prepare_ipc_directory


def test_a_missing_directory_is_created_private_and_a_private_one_is_taken(tmp_path):
    directory = tmp_path / "run" / "pagoda"
    prepare_ipc_directory(f"ipc://{directory}/worker.sock")
    assert directory.stat().st_mode & 0o777 == 0o700
    prepare_ipc_directory(f"ipc://{directory}/worker.sock")  # again: fine
    directory.chmod(0o755)  # readable by others: they still cannot replace the socket
    prepare_ipc_directory(f"ipc://{directory}/worker.sock")
    prepare_ipc_directory("tcp://127.0.0.1:5555")  # nothing to prepare


def test_a_directory_others_can_write_is_refused(tmp_path):
    directory = tmp_path / "planted"
    directory.mkdir()
    directory.chmod(0o777)
    with pytest.raises(UnsafeSocketDirectory, match="writable by others"):
        prepare_ipc_directory(f"ipc://{directory}/worker.sock")


def test_a_symbolic_link_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafeSocketDirectory, match="not a directory"):
        prepare_ipc_directory(f"ipc://{tmp_path / 'link'}/worker.sock")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory away needs root")
def test_another_users_directory_is_refused(tmp_path):
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    with pytest.raises(UnsafeSocketDirectory, match="belongs to uid 65534"):
        prepare_ipc_directory(f"ipc://{directory}/worker.sock")
