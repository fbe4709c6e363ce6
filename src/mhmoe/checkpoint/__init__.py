"""Checkpoints: the directory format and everything that reads or writes it, below the model layer.

Layout of one checkpoint (``RUN/checkpoints/step_00000600/``)::

    model.safetensors     weights (tied tensors stored once)           single-file format
    dcp/                  .metadata + __<rank>_0.distcp: {"model", "optim"} FQN-keyed, sharded (DCP format)
    config.yaml           the full RunConfig
    trainer_state.pt      optimizer (single-file format), LR scheduler, RNG states, step, counters
                          (tensors + plain data, loaded with ``weights_only=True``)
    tokenizer/            the tokenizer files (see mhmoe.data.Tokenizer.save)
    meta.json             step, format version ("format": "dcp" for sharded), sha256 and size of every
                          file above (written last)

Modules: :mod:`.layout` (every file and directory name), :mod:`.format` (meta.json, listing, the
newest-valid fallback, publication), :mod:`.write` (saving), :mod:`.read` (:func:`open_checkpoint`,
weights, trainer state), :mod:`.dcp_metadata` and :mod:`.dcp_reader` (the restricted DCP reader). This
package builds no model and no tokenizer: it reads and writes files, so the model layer
(``LM.from_pretrained``), the loading layer (:mod:`mhmoe.loading`: ``load_checkpoint``, ``load_latest``,
``mhmoe.load``) and a resume (:mod:`mhmoe.train.resume`) read run directories through the same
:func:`open_checkpoint` and :func:`newest_valid`. Collective (torchrun) saving and resharded loading:
:mod:`mhmoe.parallel.checkpoint`.

Checkpoints are downloaded and shared: loading one never executes code from it and never reads
outside its directory (see docs/SAFETY.md).
"""
