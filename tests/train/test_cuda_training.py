"""Training on CUDA (skipped without a GPU): no host synchronisation inside a dropless training step (with activation
checkpointing too, which trains the same weights), bf16 training lowers the loss with the default execution path,
and the CLI trains, evaluates and generates on CUDA with no extra flags."""

from pathlib import Path

import pytest
import torch
from helpers import MHMOE, SMOE, records, tiny_run

from mhmoe.cli import main
from mhmoe.config.moe import MoEConfig
from mhmoe.train.loop import Trainer, train
from mhmoe.train.parallelism import SingleProcess

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("moe", [SMOE, MHMOE, MoEConfig(n_experts=6, top_k=2, d_expert=16, router="xmoe",
                                                        aux_free_bias=True)], ids=["smoe", "mhmoe", "xmoe-auxfree"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_steps_never_wait_for_the_device(tmp_path, moe, dtype):
    run = tiny_run(tmp_path, moe, device="cuda", dtype=dtype, max_steps=50, log_every=1000)
    _, results = steps_without_syncs(run, tmp_path / "r", 4)
    assert all(bool(r.finite) for r in results)


def steps_without_syncs(run, run_dir: Path, n: int) -> tuple[Trainer, list]:
    """Two warm-up steps (allocator, cuBLAS handles, autotuning), then ``n`` steps in which any host
    synchronisation raises: the trainer and those steps' results."""
    trainer = Trainer(run, run_dir, resume=False, progress=False, stop_after=None,
                      parallelism=SingleProcess(torch.device("cuda")))
    results = [trainer.train_step(step) for step in range(2)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results += [trainer.train_step(step) for step in range(2, 2 + n)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return trainer, results[2:]


def test_grouped_query_attention_with_qk_norm_steps_never_wait_for_the_device(tmp_path):
    """SDPA's grouped-query path (``enable_gqa``) and the query/key norms on CUDA, bf16; then decoding with the KV
    cache (KV heads) gives the full forward's logits (a wrong head grouping would be off by O(1))."""
    from mhmoe.model.lm import KVCache

    run = tiny_run(tmp_path, MHMOE, device="cuda", dtype="bfloat16", max_steps=50, log_every=1000).with_overrides(
        ["model.n_kv_heads=2", "model.qk_norm=true"])
    trainer, results = steps_without_syncs(run, tmp_path / "r", 4)
    assert all(bool(r.finite) for r in results)
    model = trainer.model.eval()
    x = torch.randint(0, 256, (2, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    cache = KVCache(model.cfg.n_layers)
    with torch.no_grad():
        full = model(x).logits
        steps = [model(x[:, :5], cache=cache).logits] + [model(x[:, t:t + 1], cache=cache).logits
                                                          for t in range(5, 12)]
    assert cache.k[0].shape[1] == 2
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode", ["moe", "blocks"])
def test_recomputing_training_steps_never_wait_for_the_device(tmp_path, mode):
    """Activation checkpointing on the default bf16 path: no host synchronisation either, and the same losses
    and weights as the steps that keep their activations (the recomputation runs the same kernels on the same
    inputs)."""
    got = {}
    for m in ("none", mode):
        run = tiny_run(tmp_path, MHMOE, device="cuda", dtype="bfloat16", max_steps=50, log_every=1000,
                       activation_checkpointing=m)
        trainer, results = steps_without_syncs(run, tmp_path / m, 3)
        got[m] = ([float(r.lm_loss) for r in results], trainer.model.state_dict())
    assert got[mode][0] == pytest.approx(got["none"][0], rel=1e-5)
    for k, v in got["none"][1].items():
        torch.testing.assert_close(got[mode][1][k], v, rtol=1e-4, atol=1e-6, msg=k)


def test_bf16_training_lowers_the_loss_on_cuda(tmp_path):
    run = tiny_run(tmp_path, MHMOE, device="cuda", dtype="bfloat16", max_steps=30, lr=3e-3)
    res = train(run, tmp_path / "r", progress=False)
    losses = [r["loss"] for r in records(tmp_path / "r")]
    assert res.step == 30 and res.nan_skips == 0
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_float16_training_lowers_the_loss_on_cuda(tmp_path):
    """float16 with its loss scale (GPUs without bf16 run this; the H100 runs it as well)."""
    run = tiny_run(tmp_path, MHMOE, device="cuda", dtype="float16", max_steps=30, lr=3e-3)
    res = train(run, tmp_path / "r", progress=False)
    recs = records(tmp_path / "r")
    losses = [r["loss"] for r in recs]
    assert res.step == 30 and res.nan_skips == 0 and len(losses) >= 10 and recs[-1]["loss_scale"] > 0
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_cli_trains_evaluates_and_generates_on_cuda_in_bf16(tmp_path: Path, capsys):
    run = tiny_run(tmp_path, MHMOE, max_steps=4)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(run.to_yaml())
    out = tmp_path / "r"
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress", "--set", "train.device=cuda",
                 "--set", "train.dtype=bfloat16"]) == 0
    assert main(["eval", "--checkpoint", str(out), "--json"]) == 0
    assert main(["generate", "--checkpoint", str(out), "--prompt", "in the", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out


def test_bench_moe_runs_on_cuda(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "moe", "--device", "cuda", "--configs", "mh3", "--dtypes", "bfloat16", "--tokens", "2048",
                 "--repeats", "2", "--no-loop", "--json", str(out)]) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_training_with_cuda_graphs(tmp_path, dtype):
    """train.compile with train.cuda_graphs: the default path's forward and backward replay as CUDA graphs;
    the losses track eager training closely and the routing statistics survive later replays."""
    losses = {}
    for graphs in (False, True):
        run = tiny_run(tmp_path, MHMOE, device="cuda", dtype=dtype, max_steps=8, log_every=1, compile=graphs,
                       cuda_graphs=graphs)
        train(run, tmp_path / f"r{graphs}", progress=False)
        recs = records(tmp_path / f"r{graphs}")
        assert len(recs) == 8 and all(r["tokens_per_s"] > 0 for r in recs)
        losses[graphs] = [r["loss"] for r in recs]
    tol = 5e-2 if dtype == "bfloat16" else 1e-2  # compiled kernels round differently; routing may flip
    assert losses[True] == pytest.approx(losses[False], rel=tol)
