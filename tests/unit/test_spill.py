"""The log source's spill file: messages appended, read back by position one at a time or as a
run, and cut back; made in the directory given, which is checked first."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from harvester import Harvester, HarvesterConfig
from harvester.postgres.log.spill import Spill, spill_directory
from tests.support.harvesters import ManualElector

pytestmark = pytest.mark.unit


def test_messages_come_back_by_position_and_a_cut_forgets_the_later_ones() -> None:
    spill = Spill()
    try:
        messages = [b"", b"I" * 3, bytes(range(256)), b"x"]
        for m in messages:
            spill.append(m)
        assert len(spill) == 4
        assert [spill.read(i, i + 1)[0] for i in range(4)] == messages
        assert spill.read(1, 4) == messages[1:] and spill.read(2, 2) == []
        with pytest.raises(IndexError):
            spill.read(4, 5)
        spill.truncate(2)
        spill.append(b"after")
        assert spill.read(0, 3) == [b"", b"III", b"after"]
    finally:
        spill.close()


def test_spill_files_go_to_the_directory_given_and_one_that_takes_no_file_is_refused(tmp_path: Path) -> None:
    assert spill_directory(str(tmp_path)) == str(tmp_path)
    assert spill_directory(None) == tempfile.gettempdir()
    spill = Spill(str(tmp_path))
    try:
        # Unnamed, so not listed; the descriptor's link names the directory it was made in.
        assert os.readlink(f"/proc/self/fd/{spill._file.fileno()}").startswith(f"{tmp_path}/")
        assert not list(tmp_path.iterdir())
    finally:
        spill.close()
    with pytest.raises(ValueError, match=f"cannot make a file in {tmp_path}/missing: No such file or directory"):
        spill_directory(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="Not a directory"):
        spill_directory(str(tmp_path / "file"))


def test_a_harvester_of_the_log_source_refuses_a_spill_directory_that_takes_no_file(tmp_path: Path) -> None:
    config = HarvesterConfig(source="log", log_spill_directory=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"logSpillDirectory: cannot make a file in .*/missing: No such file"):
        Harvester(config, elector=ManualElector())
