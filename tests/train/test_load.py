"""``mhmoe.load``: model + tokenizer of a run, checkpoint or saved directory; generating from Python gives
the text ``mhmoe generate`` prints for the same seed."""

from __future__ import annotations

import pytest
from helpers import tiny_run

import mhmoe
from mhmoe.cli import main
from mhmoe.errors import CheckpointError, ConfigError
from mhmoe.loading.pretrained import Pretrained, load
from mhmoe.train.loop import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    train(tiny_run(root, max_steps=3), root / "run", progress=False)
    return root / "run"


def test_load_a_run_and_generate_like_the_cli(run_dir, capsys):
    lm = mhmoe.load(run_dir, device="cpu")
    assert isinstance(lm, Pretrained) and lm.step == 3 and lm.run.name == "tiny-test" and not lm.model.training
    text = lm.generate("in the beginning", max_new_tokens=12, seed=3)
    assert text.startswith("in the beginning") and len(text) > len("in the beginning")
    assert main(["generate", "--checkpoint", str(run_dir), "--prompt", "in the beginning", "--max-new-tokens", "12",
                 "--seed", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == text
    greedy = {lm.generate("in the", max_new_tokens=8, temperature=0, seed=s) for s in range(3)}
    assert len(greedy) == 1  # temperature 0 ignores the seed


def test_saved_directory_round_trip_keeps_the_tokenizer(run_dir, tmp_path):
    lm = load(run_dir, "cpu")
    lm.save_pretrained(tmp_path / "saved")
    again = load(tmp_path / "saved", "cpu")
    assert again.step is None and again.tokenizer.fingerprint == lm.tokenizer.fingerprint
    assert again.generate("word", max_new_tokens=10, seed=1) == lm.generate("word", max_new_tokens=10, seed=1)
    lm.model.save_pretrained(tmp_path / "bare")  # no tokenizer: generate says what is missing
    with pytest.raises(ConfigError, match="tokenizer"):
        load(tmp_path / "bare", "cpu").generate("word")


@pytest.mark.parametrize("kwargs, field", [({"prompt": ""}, "prompt"), ({"max_new_tokens": 0}, "max_new_tokens"),
                                           ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                           ({"top_k": -1}, "top_k"), ({"prompt": "x" * 80}, "prompt")])
def test_bad_generation_arguments_name_the_argument(run_dir, kwargs, field):
    lm = load(run_dir, "cpu")
    args = {"prompt": "word", **kwargs}
    with pytest.raises(ConfigError) as info:
        lm.generate(**args)
    assert info.value.field == field


def test_errors_are_one_line(tmp_path):
    with pytest.raises(CheckpointError):
        load(tmp_path / "missing", "cpu")
    with pytest.raises(ConfigError):
        load(tmp_path, "tpu")
