"""``train.compile`` on the default CUDA paths: the model's training forward traces into one graph (no graph break, no
op that would read the device on the host), checked on CPU in bf16 with ``grouped_mm`` (the bf16 default on Hopper;
``torch._grouped_mm`` runs on CPU too); ``train.cuda_graphs`` compiles with CUDA-graph capture, refused without
compile or off CUDA; activation checkpointing keeps the one graph. (The Triton path, the fp32 default, is checked
the same way in tests/moe/test_triton_dispatch.py, under the interpreter.)"""

import pytest
import torch

from mhmoe.config import get_preset
from mhmoe.config.train import TrainConfig
from mhmoe.errors import ConfigError
from mhmoe.model.lm import LM
from mhmoe.model.recompute import set_activation_checkpointing
from mhmoe.train.loop import compiled

SYNC_METHODS = {"item", "tolist", "cpu", "nonzero", "numpy"}  # ops that read the device on the host
SYNC_FUNCTIONS = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "bincount")


def _host_read(node) -> bool:
    if node.op == "call_method":
        return node.target in SYNC_METHODS
    name = getattr(node.target, "__name__", str(node.target))
    return node.op == "call_function" and any(name.endswith(f) for f in SYNC_FUNCTIONS)


def graph_breaks(model, *args) -> tuple[int, int, list[str]]:
    """(graphs, breaks, host-reading ops in the graphs) of ``model(*args)`` under bf16 autocast."""
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ex = torch._dynamo.explain(model)(*args)
    syncs = [str(n.target) for g in ex.graphs for n in g.graph.nodes if _host_read(n)]
    return ex.graph_count, ex.graph_break_count, syncs


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("preset", ["tiny-mh3", "tiny-smoe"])
def test_training_forward_is_one_graph_on_grouped_mm(preset):
    run = get_preset(preset).with_overrides(["model.moe.impl=grouped_mm", "model.vocab_size=300", "model.n_layers=2",
                                             "model.max_seq_len=32", "train.seq_len=32"])
    torch.manual_seed(0)
    model = LM(run.model).train()
    x, y = torch.randint(0, 300, (2, 32)), torch.randint(0, 300, (2, 32))
    graphs, breaks, syncs = graph_breaks(model, x, y)
    assert (graphs, breaks, syncs) == (1, 0, [])


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("mode", ["moe", "blocks"])
def test_recomputing_training_forward_is_one_graph(mode):
    """Activation checkpointing (mhmoe.model.recompute) traces into the same single graph, without host reads."""
    run = get_preset("tiny-mh3").with_overrides(["model.moe.impl=grouped_mm", "model.vocab_size=300",
                                                 "model.n_layers=2", "model.max_seq_len=32", "train.seq_len=32"])
    torch.manual_seed(0)
    model = LM(run.model).train()
    assert set_activation_checkpointing(model, mode) == (1 if mode == "moe" else 2)
    x, y = torch.randint(0, 300, (2, 32)), torch.randint(0, 300, (2, 32))
    assert graph_breaks(model, x, y) == (1, 0, [])


def test_cuda_graphs_option(monkeypatch):
    with pytest.raises(ConfigError, match="train.cuda_graphs"):
        TrainConfig(cuda_graphs=True)
    assert TrainConfig(compile=True, cuda_graphs=True).cuda_graphs
    modes = []
    monkeypatch.setattr(torch, "compile", lambda m, mode=None: modes.append(mode) or m)
    module = torch.nn.Linear(2, 2)
    assert compiled(module, False, False, torch.device("cpu")) is module and modes == []
    compiled(module, True, False, torch.device("cpu"))
    compiled(module, True, True, torch.device("cuda"))  # nothing touches the device until the first call
    assert modes == [None, "reduce-overhead"]
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device"):
        compiled(module, True, True, torch.device("cpu"))
