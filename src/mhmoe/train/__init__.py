"""The training layer: the loop (:mod:`.loop`), optimizer and schedules (:mod:`.optim`), checkpoints
loaded back into a model and trainer state and ``mhmoe.load`` (:mod:`.checkpoint`), evaluation
(:mod:`.evaluate`), logging (:mod:`.metrics`) and the single-process parallelism interface
(:mod:`.parallelism`) that :mod:`mhmoe.parallel` implements for torchrun."""

from mhmoe.train.checkpoint import (
    Checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
    verify_checkpoint,
)
from mhmoe.train.evaluate import evaluate
from mhmoe.train.loop import Trainer, TrainResult, train
from mhmoe.train.optim import build_optimizer, lr_lambda, weight_decay_at
from mhmoe.train.parallelism import SingleProcess

__all__ = [
    "Checkpoint", "SingleProcess", "TrainResult", "Trainer", "build_optimizer", "evaluate", "list_checkpoints",
    "load_checkpoint", "load_latest", "lr_lambda", "save_checkpoint", "train", "verify_checkpoint", "weight_decay_at",
]
