"""benchmarks/train_throughput.py runs the training step's pieces in every training dtype and with activation
checkpointing (tiny shapes; nothing is compared against a speed)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_script

train_throughput = load_script("benchmarks/train_throughput.py")


@pytest.mark.parametrize("dtype, recompute", [("float16", "moe"), ("float32", "blocks")])
def test_a_preset_steps_in_each_dtype_and_recomputation(dtype, recompute):
    row = train_throughput.bench_preset("tiny-mh3", torch.device("cpu"), dtype, steps=1, warmup=1, batch_size=2,
                                        seq_len=16, overrides=["model.n_layers=2",
                                                               f"train.activation_checkpointing={recompute}"])
    assert row["dtype"] == dtype and row["tokens_per_s"] > 0 and row["tokens_per_step"] == 32
