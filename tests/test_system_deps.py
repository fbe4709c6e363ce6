"""scripts/install-system-deps.sh (``make system-deps``, run by ``make test`` and ``make demo``) never installs
silently and never fails the make target: it says what it installs and why and shows apt-get's own
output; without apt-get, as a non-root user or when apt-get fails it prints one line and exits 0. Run
against an empty root (every package missing) with fake ``apt-get``, ``id`` and ``debconf-set-selections``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install-system-deps.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def _run(tmp_path: Path, *, apt: str | None = None, uid: int = 0, mode: str = "yes") -> subprocess.CompletedProcess:
    """The script with PATH = a directory of fakes (and the few tools it needs), packages looked up in an empty root."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("wc", "fold"):
        if not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(shutil.which(tool))
    fakes = {"id": f"echo {uid}", "debconf-set-selections": "cat > /dev/null"}
    if apt is not None:
        fakes["apt-get"] = apt
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!{BASH}\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": str(bin_dir), "SYSTEM_DEPS_ROOT": str(tmp_path / "root"), "SYSTEM_DEPS": mode}
    return subprocess.run([BASH, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def test_says_what_and_why_then_shows_apt_gets_output(tmp_path):
    log = tmp_path / "apt.log"
    res = _run(tmp_path, apt=f'echo "$@" >> {log}; echo "Setting up wordnet-base (fake) ..."')
    assert res.returncode == 0
    err = res.stderr
    assert err.startswith("mhmoe: installing 67 Debian packages with apt-get for the pydocs validation set, WordNet "
                          "validation set, man-page corpora, emoji image set, debdocs training corpus (skip with "
                          "SYSTEM_DEPS=no):")
    assert "python3.11-doc" in err and "fonts-noto-color-emoji" in err
    assert "Setting up wordnet-base (fake) ..." in res.stdout  # apt-get's output is shown, not discarded
    assert "mhmoe: installed the 67 packages" in err
    assert log.read_text().startswith("install -y -q --no-install-recommends python3.11-doc wordnet-base")


@pytest.mark.parametrize("case, kwargs, needle", [
    ("no apt-get", {}, "no apt-get on this system: 67 optional Debian packages not installed"),
    ("not root", {"apt": "exit 99", "uid": 1000}, "not root: 67 optional Debian packages not installed (as root: "
                                                   "apt-get install python3.11-doc"),
    ("apt fails", {"apt": "exit 100"}, "apt-get could not install the packages above"),
])
def test_where_apt_cannot_run_one_line_and_success(tmp_path, case, kwargs, needle):
    res = _run(tmp_path, **kwargs)
    assert res.returncode == 0, case
    notes = [ln for ln in res.stderr.splitlines() if ln.startswith("mhmoe: note:")]
    assert len(notes) == 1 and needle in notes[0], res.stderr
    assert "are skipped (one warning line each); to install them later: make system-deps" in notes[0]


def test_skip_and_check(tmp_path):
    assert _run(tmp_path, apt="exit 99", mode="no").stderr == ""
    res = _run(tmp_path, apt="exit 99", mode="check")
    assert res.returncode == 0 and res.stderr.startswith("mhmoe: note: 67 optional Debian packages are missing")


def test_test_mode_leaves_out_the_corpus_packages(tmp_path):
    log = tmp_path / "apt.log"
    res = _run(tmp_path, apt=f'echo "$@" >> {log}', mode="test")
    assert res.returncode == 0 and "installing 29 Debian packages" in res.stderr
    assert "debdocs" not in res.stderr and "linux-doc-6.1" not in log.read_text()


def test_corpus_packages_are_the_readers():
    from mhmoe.data.debdocs import PACKAGES

    listed = SCRIPT.read_text().split('CORPUS_PKGS="', 1)[1].split('"', 1)[0].split()
    assert listed == list(PACKAGES)


def test_nothing_to_do_when_everything_is_installed(tmp_path):
    root = tmp_path / "root"
    (root / "usr/share/doc/python3.11/html/_sources").mkdir(parents=True)
    (root / "usr/share/wordnet").mkdir(parents=True)
    (root / "usr/share/wordnet/data.noun").write_text("")
    info = root / "var/lib/dpkg/info"
    info.mkdir(parents=True)
    script = SCRIPT.read_text()
    names = script.split('MAN_PKGS="', 1)[1].split('"', 1)[0].split() + ["fonts-noto-color-emoji"]
    names += script.split('CORPUS_PKGS="', 1)[1].split('"', 1)[0].split()
    for name in names:
        (info / f"{name}.list").write_text("")
    res = _run(tmp_path, apt="exit 99")
    assert res.returncode == 0 and res.stderr == "" and res.stdout == ""
    assert os.environ.get("SYSTEM_DEPS_ROOT") is None  # the test's root never leaks
