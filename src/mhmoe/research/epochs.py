"""Epoch accounting: how many tokens a run's training corpus has, so that every result states the epochs
it trained (tokens seen / training tokens) and a suite can refuse or warn before it trains too long."""

from __future__ import annotations

from mhmoe.config.run import RunConfig


def data_version(run: RunConfig, progress: bool = False) -> dict | None:
    """What identifies the data ``run`` trains and evaluates on, beyond its config: the training split's token
    count and the tokenizer's fingerprint (first 16 hex digits). A registry corpus read from installed packages
    (``debdocs``) changes with their versions, and with it the BPE trained on it, so runs of one config on two
    machines can see different text. None for a masked multi-modal run."""
    if run.data.task != "lm":
        return None
    from mhmoe.data import prepare_data
    from mhmoe.data import train_tokens as count

    prepared = prepare_data(run.data, seq_len=run.train.seq_len, progress=progress)
    return {"train_tokens": count(prepared), "tokenizer": prepared.tokenizer.fingerprint[:16]}
