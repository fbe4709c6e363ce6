"""Loading what training wrote, for everything that is not training: a checkpoint's model, tokenizer and
trainer state (:mod:`.checkpoint`: :class:`~mhmoe.loading.checkpoint.Checkpoint`, ``load_checkpoint``,
``load_latest``) and a model ready to generate from Python (:mod:`.pretrained`: ``mhmoe.load``,
``Pretrained``, the sampling defaults). Above the model and data layers (a model and its tokenizer),
below training: ``eval``, ``generate``, ``export``, ``analyze`` and the integrations load through here;
a resume adds its checks in :mod:`mhmoe.train.resume`."""
