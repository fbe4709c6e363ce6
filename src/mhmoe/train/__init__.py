"""The training layer: the loop (:mod:`.loop`, :func:`train`), the objectives (:mod:`.objectives`), optimizer
and schedules (:mod:`.optim`), what a resume checks and takes from the command (:mod:`.resume`), the
checkpoint format conversions (:mod:`.convert`), evaluation (:mod:`.evaluate`), logging (:mod:`.metrics`),
progress and curves (:mod:`.progress`, :mod:`.plots`), the run-directory lock (:mod:`.lock`) and the
single-process parallelism interface (:mod:`.parallelism`) that :mod:`mhmoe.parallel` implements for
torchrun. Loading a trained model is :mod:`mhmoe.loading`, one layer below."""

from mhmoe.train.loop import train

__all__ = ["train"]
