import pytest
import torch


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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
