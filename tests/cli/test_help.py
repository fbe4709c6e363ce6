"""``--help`` that helps: every option of every subcommand has a help text and says its default, and
the first-class flags map onto the config fields they name."""

from __future__ import annotations

import argparse

import pytest

from mhmoe.cli import HelpFormatter, build_parser, main
from mhmoe.cli.train import RUN_FLAGS, _load_run, flag_overrides


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _options(sub: argparse.ArgumentParser):
    return [a for a in sub._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", sorted(_subparsers()))
def test_every_option_has_help_and_says_its_default(name):
    sub = _subparsers()[name]
    formatter = HelpFormatter(prog="mhmoe")
    missing = []
    for action in _options(sub):
        text = formatter._get_help_string(action)
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if not (action.help or "").strip():
            missing.append(f"{action.option_strings[0]}: no help")
        elif not (flag or action.required or "default" in text):
            missing.append(f"{action.option_strings[0]}: no default shown ({text!r})")
    assert not missing, f"mhmoe {name}: " + "; ".join(missing)
    assert sub.format_help()  # renders


def test_defaults_appear_in_the_rendered_help(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 100)", "(default: 0.8)", "(default: 50)", "(default: 0.95)", "(default: 0)"):
        assert default in out, default


def test_first_class_flags_map_onto_the_config():
    args = build_parser().parse_args(["train", "--out", "x", "--preset", "tiny-smoe", "--lr", "3e-4", "--batch-size",
                                      "4", "--seed", "7", "--device", "cpu", "--dtype", "bfloat16", "--eval-every",
                                      "25", "--max-steps", "9", "--set", "train.lr=1.0", "--set", "model.moe.top_k=2"])
    run = _load_run(args)
    t = run.train
    assert (t.lr, t.batch_size, t.seed, t.device, t.dtype, t.eval_every, t.max_steps) == \
        (3e-4, 4, 7, "cpu", "bfloat16", 25, 9)  # the flag wins over --set train.lr
    assert run.model.moe.top_k == 2 and run.name == "tiny-smoe"
    assert flag_overrides(build_parser().parse_args(["train", "--out", "x"])) == []  # nothing given, nothing set
    assert set(RUN_FLAGS.values()) <= {f"train.{k}" for k in vars(t)} | {"data.corpus"}


@pytest.mark.parametrize("argv, needle", [(["--lr", "-1"], "train.lr"), (["--batch-size", "0"], "train.batch_size"),
                                          (["--eval-every", "-2"], "train.eval_every")])
def test_invalid_flag_values_are_one_line_config_errors(tmp_path, capsys, argv, needle):
    assert main(["train", "--out", str(tmp_path / "r"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_choices_are_checked_by_the_parser(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--out", "x", "--dtype", "float64"])
    assert info.value.code == 2 and "float64" in capsys.readouterr().err


def test_every_subcommand_is_summarised_and_described(capsys):
    from mhmoe.cli import COMMANDS

    subs = _subparsers()
    assert list(subs) == list(COMMANDS)
    with pytest.raises(SystemExit):
        main(["--help"])
    listing = "".join(capsys.readouterr().out.split())  # without the line wrapping
    for name, (_, summary) in COMMANDS.items():
        assert name + "".join(summary.split()) in listing, name  # `mhmoe --help` says what every command does
        assert (subs[name].description or "").strip(), f"mhmoe {name} --help has no description"


def test_help_shows_the_presets_values():
    from mhmoe.config.presets import get_preset

    def option(command: str, flag: str) -> str:
        action = next(a for a in _subparsers()[command]._actions if flag in a.option_strings)
        return HelpFormatter(prog="mhmoe")._get_help_string(action)

    steps = get_preset("tiny-mh3").train.max_steps
    assert option("train", "--max-steps").endswith(f"(default: the preset's: {steps} for tiny-mh3)")
    lrs = {get_preset(n).train.lr for n in ("tiny-dense", "tiny-smoe", "tiny-mh3")}
    assert len(lrs) == 1 and option("compare", "--lr").endswith(f"(default: each preset's: {lrs.pop()})")
    assert "the preset's: auto for tiny-mh3" in option("train", "--device")


def test_version_and_did_you_mean(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("mhmoe ")
    assert main(["trian", "--out", "x"]) == 2
    assert capsys.readouterr().err == ("mhmoe: error: unknown command 'trian'; did you mean train? "
                                       "(`mhmoe --help` lists them)\n")
    assert main(["train", "--out", "x", "--preset", "tiny-mh33"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid preset='tiny-mh33': did you mean tiny-mh3?" in err
    assert "paper-dense" not in err  # not the 70 names
    assert main(["train", "--out", "x", "--set", "model.moe.topk=2"]) == 2
    assert "did you mean top_k?" in capsys.readouterr().err
