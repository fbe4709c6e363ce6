"""Fixtures of the research tests: suites trained by fake trainers never tokenize a corpus to count its
training tokens (a test that wants the real count marks itself ``real_train_tokens``)."""

import pytest

KJV_TRAIN_TOKENS = 875_290  # the KJV training split under the tiny presets' BPE (docs/DATA.md)
KJV_TOKENIZER = "0123456789abcdef"  # a stand-in fingerprint


def pytest_configure(config):
    config.addinivalue_line("markers", "real_train_tokens: count the training corpus's tokens for real")


@pytest.fixture(autouse=True)
def _fixed_train_tokens(request, monkeypatch):
    if request.node.get_closest_marker("real_train_tokens") is None:
        monkeypatch.setattr("mhmoe.research.epochs.data_version", lambda run, progress=False: {
            "train_tokens": KJV_TRAIN_TOKENS, "tokenizer": KJV_TOKENIZER} if run.data.task == "lm" else None)
