"""Fixtures of the checkpoint tests: a trained run directory (checkpoints at steps 4 and 6) and private
copies of it to damage."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import MHMOE, tiny_run

from mhmoe.train.loop import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 6-step run with checkpoints every 2 steps and keep_last=2 (-> steps 4 and 6)."""
    root = tmp_path_factory.mktemp("ckpt")
    threads = torch.get_num_threads()
    train(tiny_run(root, MHMOE, ckpt_every=2, keep_last=2), root / "run", progress=False)
    torch.set_num_threads(threads)
    return root / "run"


@pytest.fixture
def run_dir(trained, tmp_path):
    """A private copy of the trained run, free to corrupt."""
    dst = tmp_path / "run"
    shutil.copytree(trained, dst)
    return dst
