"""benchmarks/gemm_efficiency.py --cold: each case gives its operands to every expert or shares them, and every
config's up-projection is timed in every case (tiny shapes; no speed is compared)."""

from __future__ import annotations

import torch
from helpers import load_script

gemm_efficiency = load_script("benchmarks/gemm_efficiency.py")


def test_sweep_gives_each_named_operand_to_every_gemm(monkeypatch):
    made: list[tuple[int, ...]] = []
    real = torch.randn

    def counting(shape, dtype):
        made.append(tuple(shape))
        return real(shape, dtype=dtype)

    monkeypatch.setattr(gemm_efficiency.torch, "randn", counting)
    assert gemm_efficiency.sweep_ms(4, 8, 16, torch.float32, 3, ("weight",), sweeps=1) > 0
    assert made.count((4, 8)) == 1 and made.count((8, 16)) == 3 and made.count((4, 16)) == 1
    made.clear()
    gemm_efficiency.sweep_ms(4, 8, 16, torch.float32, 3, gemm_efficiency.COLD_CASES["cold"], sweeps=1)
    assert made.count((4, 8)) == made.count((8, 16)) == made.count((4, 16)) == 3


def test_cold_rows_time_every_config_and_case(monkeypatch):
    monkeypatch.setattr(gemm_efficiency, "CONFIGS", {"tiny": (4, 32, 2, 2)})
    (row,) = gemm_efficiency.cold_rows(tokens=16, sweeps=1, dtypes=(torch.float32,))
    assert (row["config"], row["m"], row["k_in"], row["n_hidden"]) == ("tiny", 16, 384, 32)  # 16 x 2 x 2 / 4 rows
    assert all(row[f"ms_{case}"] > 0 for case in gemm_efficiency.COLD_CASES)
