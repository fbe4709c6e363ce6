"""A rank that loses a peer (``kill -9``, the out-of-memory killer, a network failure) under a torchrun-style
launch ends with one line naming the peer and the last checkpoint, exit status 1, no traceback. Two gloo
ranks of the real ``mhmoe train`` CLI, launched the way torchrun launches them (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); rank 1 is killed after the first checkpoint.

Before: rank 0 printed a 60-line traceback ending in gloo's "Connection closed by peer"."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import MHMOE, run_messages, tiny_run

import mhmoe
from mhmoe.checkpoint.format import list_checkpoints, verify_checkpoint

pytestmark = [pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
              pytest.mark.slow]  # two processes start torch and train: ~30 s of CPU (make test-all runs it)
SRC = Path(mhmoe.__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_loses_its_peer_says_so_in_one_line(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(tiny_run(tmp_path, MHMOE, max_steps=100_000, ckpt_every=2, eval_every=0, warmup_steps=0).to_yaml())
    out, port = tmp_path / "run", _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, "-m", "mhmoe", "train", "--config", str(cfg), "--out", str(out),
                                       "--parallel", "ddp", "--no-progress"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 240
        while not list_checkpoints(out) and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:] for p in procs]
            time.sleep(0.2)
        assert list_checkpoints(out), "no checkpoint in time"
        procs[1].send_signal(signal.SIGKILL)
        _, err = procs[0].communicate(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    lines = run_messages(err)
    assert procs[0].returncode == 1 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    newest = list_checkpoints(out)[-1]
    step = int(newest.name.split("_")[-1])
    assert lines[0] == (f"mhmoe train: rank 0: lost rank 1 of 2 (killed, out of memory or a network failure); the last "
                        f"checkpoint is step {step} ({newest}): continue with --resume"), lines[0]
    assert verify_checkpoint(newest)["step"] == step
