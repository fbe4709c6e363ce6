"""The run-directory lock needs filelock >= 4 (FileLock's on_acquired hook): an older filelock, as an
environment installed with ``--no-deps`` may hold, is refused in one line before anything is created."""

import filelock
import pytest

from mhmoe.errors import ConfigError
from mhmoe.train.lock import RunDirLock, require_filelock


@pytest.mark.parametrize("version", ["3.20.0", "3.32.7", "", "unknown"])
def test_an_old_filelock_is_refused_in_one_line_before_the_run_directory_exists(tmp_path, monkeypatch, version):
    monkeypatch.setattr(filelock, "__version__", version)
    run = tmp_path / "runs" / "r"
    with pytest.raises(ConfigError) as err:
        RunDirLock(run).__enter__()
    msg = str(err.value)
    assert "\n" not in msg and "filelock" in msg and ">= 4.0" in msg and "pip install 'filelock>=4,<5'" in msg
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("version", ["4.0.0", "4.3.1"])
def test_filelock_4_is_accepted(version):
    require_filelock(version)


def test_the_installed_filelock_takes_the_lock(tmp_path):
    with RunDirLock(tmp_path / "r") as lock:
        assert lock.lock is not None and (tmp_path / "r" / ".lock").exists()
