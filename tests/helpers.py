"""Shared test helpers (``tests/`` is on sys.path: pyproject ``[tool.pytest.ini_options] pythonpath``):
the oracle pair for layer tests and tiny training runs on a generated corpus."""

import copy
import importlib.util
import json
import random
import re
import signal
import sys
from pathlib import Path

from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.moe.layers import build_ffn_layer

# bf16 keeps 8 significant bits (unit roundoff u = 2**-8); a layer's outputs and gradients go through a few
# roundings in sequence, so their error, measured as a norm relative to the tensor's norm (elementwise
# tolerances break on the small entries, differently for every torch version), stays a small multiple of u
BF16_REL = 8 * 2.0**-8  # ~3%


def assert_close_in_norm(got, want, rel: float, name: str = "") -> None:
    """||got - want|| <= rel * ||want|| (Frobenius norms, fp32)."""
    got, want = got.detach().float(), want.detach().float()
    err, ref = float((got - want).norm()), float(want.norm())
    assert err <= rel * max(ref, 1e-12), f"{name}: relative error {err / max(ref, 1e-12):.4f} > {rel:.4f}"


def oracle_pair(d_model: int, cfg: MoEConfig):
    """Two identical layers: one running ``cfg.impl`` and one the per-expert loop oracle."""
    fast = build_ffn_layer(d_model, cfg)
    ref = copy.deepcopy(fast)
    ref_cfg = MoEConfig(**{**cfg.to_dict(), "impl": "loop"})
    for m in ref.modules():
        if hasattr(m, "cfg"):
            m.cfg = ref_cfg
    return fast, ref


DENSE = MoEConfig(kind="dense", d_expert=64)
# a corpus whose providing package is not installed (CorpusUnavailableError's message: a traceback or the CLI's line)
MISSING_CORPUS = re.compile(r"(?:corpus '[\w-]+': [^\n]*not installed|image set '[\w-]+' needs [\w-]+): [^\n]*")
SMOE = MoEConfig(n_experts=4, top_k=1, d_expert=64)
MHMOE = MoEConfig(n_experts=6, top_k=3, d_expert=16, heads=3, head_layer=True, merge_layer=True)
NOISY_MH = MoEConfig(n_experts=6, top_k=2, d_expert=16, heads=3, head_layer=True, merge_layer=True, router="noisy")
WORDS = "in the beginning was the word and light dark water earth heaven man made said god day night".split()



def sigint_default() -> None:
    """``preexec_fn`` of a child process that a test sends SIGINT: the signal's default disposition, so the
    child's Python installs its KeyboardInterrupt handler, whatever this process inherited (a ``nohup ...
    &`` or ``setsid`` job has SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def write_corpus(root: Path, n_docs: int = 12, n_words: int = 250) -> Path:
    """A directory of small text files (one document each), deterministic."""
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(n_words)) + "\n")
    return root


def tiny_run(tmp_path: Path, moe: MoEConfig = MHMOE, **train_kw) -> RunConfig:
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        write_corpus(corpus)
    t = dict(max_steps=6, batch_size=4, seq_len=32, log_every=1, eval_batches=2, warmup_steps=2, lr=1e-3,
             dtype="float32", device="cpu", threads=1)
    t.update(train_kw)
    return RunConfig(
        name="tiny-test",
        model=ModelConfig(vocab_size=0, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64, moe=moe),
        train=TrainConfig(**t),
        data=DataConfig(corpus=str(corpus), tokenizer="byte", val_sets=(), val_tokens=512,
                        cache_dir=str(tmp_path / "cache")),
    )


def rehash(ck: Path) -> None:
    """Rewrite a checkpoint's meta.json to list every file in it with its size and sha256, as a tool (or an
    attacker, who controls meta.json as well) that edited the files would."""
    import hashlib

    meta = json.loads((ck / "meta.json").read_text())
    meta["files"] = {str(p.relative_to(ck)): {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
                                              "bytes": p.stat().st_size}
                     for p in sorted(q for q in ck.rglob("*") if q.is_file() and q.name != "meta.json")}
    (ck / "meta.json").write_text(json.dumps(meta))


def flip_bytes(path: Path, offset: int | None = None) -> None:
    """Damage a file in place: two bytes in its middle (or at ``offset``) changed, its size kept."""
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    data[i + 1] ^= 0x5A
    path.write_bytes(bytes(data))


def records(run_dir: Path, file: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(ln) for ln in (Path(run_dir) / file).read_text().splitlines() if ln.strip()]


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in records(run_dir)]


def assert_same_run(a: Path, b: Path) -> None:
    """Two run directories hold the same run, bit for bit: every metrics and eval record (timings
    aside) and the newest checkpoint's weights."""
    import torch

    from mhmoe.loading.checkpoint import load_latest

    ra, rb = records(a), records(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]  # bit-exact, not approx
    timing = {"tokens_per_s"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in ra] == \
           [{k: v for k, v in r.items() if k not in timing} for r in rb]
    assert records(a, "eval.jsonl") == records(b, "eval.jsonl")
    wa, wb = load_latest(a).model.state_dict(), load_latest(b).model.state_dict()
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


# ---- overfitting ------------------------------------------------------------------------------------


def run_messages(err: str) -> list[str]:
    """The lines of a training's stderr without its header and evaluation lines (mhmoe.train.progress):
    the notes, warnings and errors a test looks for."""
    import re

    out, in_header = [], False
    for line in err.splitlines():
        if re.match(r"mhmoe train: \S+ -> ", line):
            in_header = True
            continue
        if in_header and line.startswith("  "):
            continue
        in_header = False
        if not re.match(r"step \d+/\d+  val ppl ", line):
            out.append(line)
    return out


# ---- special files at paths mhmoe reads -------------------------------------------------------------


def plant(path: Path, kind: str, size: int = 0) -> Path:
    """``path`` made a ``fifo`` (no writer: a plain open blocks), a ``zero`` symlink to /dev/zero (a plain
    read never ends) or a sparse ``large`` file of ``size`` bytes (no disk used); returns it."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb") as f:
            f.truncate(size)
    return path


def within(fn, fifos=(), seconds: float = 30.0):
    """``fn()`` in a thread that must end within ``seconds`` (its value, or its exception re-raised): a
    reader that blocked on one of ``fifos`` is released (a writer opens and closes it) and the test fails."""
    import contextlib
    import os
    import threading

    import pytest

    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail(f"blocked for more than {seconds} s on {', '.join(map(str, fifos)) or 'a read'}")
    if "error" in out:
        raise out["error"]
    return out.get("value")


def load_script(relpath: str):
    """A script of the repository (``benchmarks/cpu_memory.py``) as a module, its folder importable (the
    benchmarks import each other)."""
    path = Path(__file__).resolve().parents[1] / relpath
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module
