"""A run directory prepared by someone else, and faults during a run: what mhmoe writes never goes
through a planted symlink, a full disk or file-size limit during a checkpoint save ends in one line with
its own exit status and leaves the previous checkpoint the newest, and a new run never replaces the
logs of an earlier one.

The victims are files outside the run directory that planted symlinks point to; each test checks they
are unchanged (the unguarded writer truncated the lock's target and overwrote config.yaml's and
results.json's)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bombs import run_limited
from helpers import MHMOE, tiny_run

from mhmoe.checkpoint.format import list_checkpoints, verify_checkpoint
from mhmoe.cli import main
from mhmoe.errors import NO_SPACE_EXIT, ConfigError, UnsafePathError
from mhmoe.loading.checkpoint import load_latest
from mhmoe.train.loop import train

SECRET = "the user's own file\n"


def _victims(tmp_path: Path, names: list[str]) -> dict[str, Path]:
    out = {}
    for n in names:
        out[n] = tmp_path / f"victim-{n.strip('.')}"
        out[n].write_text(SECRET)
    return out


def _unchanged(victims: dict[str, Path]) -> None:
    for name, v in victims.items():
        assert v.read_text() == SECRET, f"{name} was written through its symlink"


@pytest.fixture(scope="module")
def run2(tmp_path_factory) -> tuple[Path, Path]:
    """A run trained to step 2 with a checkpoint (copied per test) and its root."""
    root = tmp_path_factory.mktemp("hostile")
    train(tiny_run(root, MHMOE, max_steps=2), root / "run", progress=False)
    return root, root / "run"


def _copy_run(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to, symlinks=True)
    return to


def test_resuming_a_prepared_run_replaces_planted_links_never_their_targets(run2, tmp_path):
    root, run = run2
    r = _copy_run(run, tmp_path / "r")
    names = ["config.yaml", "results.json", "metrics.jsonl", "eval.jsonl", "curves.png"]
    victims = _victims(tmp_path, names)
    for n in names:
        (r / n).unlink(missing_ok=True)
        (r / n).symlink_to(victims[n])
    res = train(tiny_run(root, MHMOE, max_steps=4), r, resume=True, progress=False)
    assert res.step == 4
    _unchanged(victims)
    # a resume never writes config.yaml (what the run is comes from its checkpoint): that link is left alone
    assert [n for n in names if (r / n).is_symlink()] == ["config.yaml"]
    assert (r / "results.json").stat().st_size > 0


def test_a_planted_lock_symlink_is_refused_in_one_line(run2, tmp_path):
    root, run = run2
    r = _copy_run(run, tmp_path / "r")
    victims = _victims(tmp_path, [".lock"])
    (r / ".lock").symlink_to(victims[".lock"])
    with pytest.raises(UnsafePathError, match=r"\.lock: is a symlink") as info:
        train(tiny_run(root, MHMOE, max_steps=4), r, resume=True, progress=False)
    assert "\n" not in str(info.value)
    _unchanged(victims)


def test_symlinked_checkpoint_directories_are_never_followed(run2, tmp_path):
    root, run = run2
    elsewhere = tmp_path / "elsewhere"
    _copy_run(run / "checkpoints", elsewhere)  # someone's real checkpoints, outside the run
    before = sorted(p.name for p in elsewhere.iterdir())
    r = _copy_run(run, tmp_path / "r")
    (r / "checkpoints" / "step_00000009").symlink_to(elsewhere / "step_00000002")  # newest by name: ignored
    res = train(tiny_run(root, MHMOE, max_steps=4), r, resume=True, progress=False)  # from step 2, not 9
    assert res.step == 4 and [p.name for p in list_checkpoints(r)] == ["step_00000002", "step_00000004"]
    assert (r / "checkpoints" / "step_00000009").is_symlink()
    assert sorted(p.name for p in elsewhere.iterdir()) == before and verify_checkpoint(elsewhere / "step_00000002")

    r2 = tmp_path / "r2"
    r2.mkdir()
    (r2 / "checkpoints").symlink_to(elsewhere)  # the whole checkpoints/ directory
    with pytest.raises(UnsafePathError, match=r"checkpoints: is a symlink"):
        train(tiny_run(root, MHMOE, max_steps=2), r2, progress=False)
    assert sorted(p.name for p in elsewhere.iterdir()) == before


def test_a_new_run_refuses_the_logs_of_an_earlier_one(run2, tmp_path):
    root, _ = run2
    r = tmp_path / "r"
    r.mkdir()
    (r / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')  # an earlier run killed before its checkpoint
    with pytest.raises(ConfigError, match="holds metrics.jsonl of an earlier run and no checkpoint: pass --resume"):
        train(tiny_run(root, MHMOE, max_steps=2), r, progress=False)
    assert (r / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'
    assert train(tiny_run(root, MHMOE, max_steps=2), r, resume=True, progress=False).step == 2  # explicit: ok


def test_an_empty_config_yaml_is_named_with_its_fix(run2, tmp_path, capsys):
    root, run = run2
    r = _copy_run(run, tmp_path / "r")
    (r / "config.yaml").write_text("")  # what a kill during the old, non-atomic write left
    cfg = tmp_path / "c.yaml"
    cfg.write_text(tiny_run(root, MHMOE, max_steps=4).to_yaml())
    assert main(["train", "--config", str(cfg), "--out", str(r), "--resume", "--max-steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(r / "config.yaml") in err and "this file is empty" in err
    assert "checkpoints/step_*/config.yaml" in err


def test_a_file_size_limit_during_a_save_keeps_the_previous_checkpoint(run2, tmp_path):
    """RLIMIT_FSIZE below the size of model.safetensors: the save of step 4 fails; one line, exit 74,
    step 2 stays the newest checkpoint and verifies, nothing half-written remains."""
    root, run = run2
    r = _copy_run(run, tmp_path / "r")
    weights = (list_checkpoints(r)[-1] / "model.safetensors").stat().st_size
    cfg = tmp_path / "c.yaml"
    cfg.write_text(tiny_run(root, MHMOE, max_steps=4).to_yaml())
    limit = weights // 2
    code = (f"import resource, sys\nresource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
            "from mhmoe.cli import main\n"
            f"sys.exit(main(['train', '--config', {str(cfg)!r}, '--out', {str(r)!r}, '--resume', '--max-steps', '4', "
            "'--no-progress']))\n")
    out = run_limited(code, memory=3 << 30, cpu_s=120, timeout=300)
    assert out.status == NO_SPACE_EXIT, (out.status, out.stderr[-3000:])
    assert "Traceback" not in out.stderr, out.stderr
    err = out.stderr.strip().splitlines()[-1]  # after the "resuming ..." note: the one line of the failure
    assert err.startswith("mhmoe train: File too large while saving step 4"), err
    assert f"while saving step 4 to {r / 'checkpoints' / 'step_00000004'}" in err, err
    assert "the previous checkpoint step 2 is intact" in err and "File too large" in err, err
    assert [p.name for p in (r / "checkpoints").iterdir()] == ["step_00000002"]
    assert load_latest(r).step == 2


def test_an_absurd_max_seq_len_is_the_out_of_memory_message(run2, tmp_path, capsys):
    root, _ = run2
    cfg = tmp_path / "c.yaml"
    cfg.write_text(tiny_run(root, MHMOE, max_steps=2).to_yaml())
    status = main(["train", "--config", str(cfg), "--out", str(tmp_path / "r"), "--no-progress",
                   "--set", "model.max_seq_len=1000000000000"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.count("\n") == 0 and "out of memory" in err and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "r" / "checkpoints")
