"""benchmarks/gpu_suite.py on CPU: every step fits the 8-minute budget of one H100 command and its command line
parses; steps run within their budgets, record their status, and a second call resumes at the first step
that has not succeeded."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


suite = _script("gpu_suite")


def test_every_step_has_a_budget_under_eight_minutes_and_its_own_json():
    names = [s.name for s in suite.STEPS]
    assert len(set(names)) == len(names)
    assert suite.STEP_LIMIT_S == 480
    for s in suite.STEPS:
        assert 0 < s.budget_s <= suite.STEP_LIMIT_S, s.name
        for out in s.outputs:
            # the file, or the folder it is written into (reproduce --out)
            folder = f"{{results}}/{out.split('/')[0]}"
            assert any(f"{{results}}/{out}" in c or c == folder for c in s.cmd), (s.name, out)
    outputs = [o for s in suite.STEPS for o in s.outputs]
    assert len(set(outputs)) == len(outputs)
    assert [s.name for s in suite.STEPS][:2] == ["machine", "warm"]  # the shared Triton cache is filled first
    env = suite.env_for_steps()
    assert "TRITON_INTERPRET" not in env and env["TRITON_CACHE_DIR"] and env["TRITON_CACHE_AUTOTUNING"] == "1"


def test_every_step_command_parses(tmp_path):
    """The options each step passes exist (a typo would cost a GPU session)."""
    from mhmoe.cli import build_parser
    from mhmoe.config.presets import get_preset

    parsers = {"benchmarks/train_throughput.py": _script("train_throughput").parse_args,
               "benchmarks/triton_moe.py": _script("triton_moe").build_parser().parse_args,
               "benchmarks/traffic_model.py": _script("traffic_model").build_parser().parse_args,
               "benchmarks/gpu_suite.py": suite.build_parser().parse_args}
    for s in suite.STEPS:
        cmd = [c.replace("{results}", str(tmp_path)) for c in s.cmd]
        assert cmd[0] == sys.executable
        if cmd[1:3] == ["-m", "mhmoe"]:
            build_parser().parse_args(cmd[3:])
        elif cmd[1:3] == ["-m", "pytest"]:
            assert "gpu" in cmd and all((ROOT / p).exists() for p in cmd if p.startswith("tests"))
        else:
            args = parsers[cmd[1]](cmd[2:])
            for preset in getattr(args, "presets", None) or []:
                get_preset(preset)


def test_steps_run_within_budget_and_resume(tmp_path, monkeypatch):
    py = sys.executable
    steps = [suite.Step("ok", (py, "-c", "open('{results}/ok.json', 'w').write('{}')"), 30, ("ok.json",)),
             suite.Step("fails", (py, "-c", "raise SystemExit(3)"), 30),
             suite.Step("slow", (py, "-c", "import time; time.sleep(60)"), 1),
             suite.Step("later", (py, "-c", "print('hi')"), 30)]
    results, out = tmp_path / "results", tmp_path / "out"
    ran = suite.run_next(results, wall_s=120, out=out, steps=steps)
    assert [(r["step"], r["rc"], r["timed_out"]) for r in ran] == [
        ("ok", 0, False), ("fails", 3, False), ("slow", 124, True), ("later", 0, False)]
    assert ran[2]["seconds"] < 20  # killed at its budget
    assert (out / "ok.json").exists() and (out / "ok.status.json").exists() and (out / "later.log").exists()
    assert [s.name for s in suite.pending(results, steps)] == ["fails", "slow"]
    again = suite.run_next(results, wall_s=120, steps=steps)
    assert [r["step"] for r in again] == ["fails", "slow"]  # the succeeded steps are not run again
    (results / "ok.json").unlink()  # a lost output makes its step pending again
    assert [s.name for s in suite.pending(results, steps)][0] == "ok"
    assert suite.run_next(results, wall_s=10, steps=steps) == []  # "ok" (budget 30 s) does not fit in 10 s


@pytest.mark.parametrize("argv, rc", [(["--list"], 0), (["--step", "nope"], 2)])
def test_cli(argv, rc, tmp_path, capsys):
    assert suite.main([*argv, "--results", str(tmp_path)]) == rc
    if rc == 0:
        assert "warm" in capsys.readouterr().out
