"""The control key must belong to the process that reads it.

A 0600 key file that another user owns (planted in a shared folder before the run wrote its own)
would let that user impersonate the orchestrator to the ranks: :func:`read_key` refuses it, while a
key the current user wrote is read as before.
"""

from __future__ import annotations

import os

import pytest

from gyre_megatron.control import read_key, write_key

OTHER_UID = 65534
"""``nobody``: a uid that is certainly not the test's own."""


def test_own_private_key_is_read(tmp_path) -> None:
    key = write_key(tmp_path / "k")
    assert os.stat(tmp_path / "k").st_uid == os.geteuid()
    assert read_key(tmp_path / "k") == key


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a file to another uid (chown) needs root")
def test_private_key_owned_by_another_user_is_refused(tmp_path) -> None:
    write_key(tmp_path / "k")
    os.chown(tmp_path / "k", OTHER_UID, OTHER_UID)
    assert oct(os.stat(tmp_path / "k").st_mode & 0o777) == oct(0o600)
    with pytest.raises(ValueError, match=f"owned by uid {OTHER_UID}, not by this process's user") as err:
        read_key(tmp_path / "k")
    assert "\n" not in str(err.value)
