"""The CPU dispatch table: which path ``impl="auto"`` runs on a CPU, per (ISA, compute dtype, shape class).

Keys: the CPU's ISA (:func:`mhmoe.runtime.cpu.cpu_isa`: ``amx``, ``avx512_bf16``, ``avx512``, ``avx2``,
``other``), the compute dtype (``float32``, ``bfloat16``; float16 uses the float32 entry) and the experts'
shape class (:func:`shape_class`). A value (:class:`CpuChoice`) names the path and its row layout
(:mod:`mhmoe.moe.dispatch.layout`): ``align`` rounds every expert's rows up to a multiple of ``align``, and
``max_batch_padding`` runs all experts as one batched GEMM per matrix whenever padding every expert to the
largest one adds at most that fraction of rows (decided per call from the row counts; negative: never).

The entries between the ``BEGIN TABLE`` / ``END TABLE`` lines are written by
``python benchmarks/cpu_dispatch.py --table`` from the measurements in ``benchmarks/results/cpu_dispatch_*.json``
(each entry names the file it comes from; ``tests/moe/test_cpu_table.py`` rebuilds the table from those files
and checks it is the one below).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mhmoe.moe.experts import GroupedExperts
from mhmoe.runtime.cpu import cpu_isa

THIN_WIDTH, WIDE_HIDDEN = 128, 1024  # thin, wide experts: d_in < THIN_WIDTH and F >= WIDE_HIDDEN
SMALL_EXPERT = 32768  # "small": d_in * F below this (a weight matrix of 64 KiB in bf16; the tiny presets' h=2, h=3)
MANY_EXPERTS = 16  # "many": at least this many experts (enough for one expert thread per core)
SHAPE_CLASSES = ("few", "many", "small", "thin_wide")
# a class with no measurement on an ISA takes that ISA's entry for this class before any other ISA's
FALLBACK_CLASS = {"small": "many"}
DTYPES = ("float32", "bfloat16")
CPU_IMPLS = ("fused", "sorted", "chunked")


@dataclass(frozen=True)
class CpuChoice:
    """One entry: ``impl`` (fused | sorted | chunked), ``align`` (rows per expert rounded to a multiple of it),
    ``max_batch_padding`` (batched GEMMs when the padding is at most this fraction; negative: never),
    ``expert_threads`` (whole experts spread over the CPU threads, :func:`mhmoe.moe.dispatch.fused.expert_workers`;
    False: every GEMM split over all threads), ``source`` (the measurement files the entry was chosen from)."""

    impl: str
    align: int
    max_batch_padding: float
    expert_threads: bool
    source: str


def classify(n_experts: int, d_in: int, d_hidden: int) -> str:
    """``thin_wide`` (d_in < 128 and F >= 1,024: MH-MoE at parameter parity with many heads), ``small`` (d_in * F
    < 32,768: every GEMM call's fixed cost weighs, e.g. the tiny presets' h=2 and h=3 experts), ``many`` (at least
    16 experts) or ``few``."""
    if d_in < THIN_WIDTH and d_hidden >= WIDE_HIDDEN:
        return "thin_wide"
    if d_in * d_hidden < SMALL_EXPERT:
        return "small"
    return "many" if n_experts >= MANY_EXPERTS else "few"


def shape_class(experts: GroupedExperts) -> str:
    """The shape class of ``experts`` (:func:`classify`)."""
    return classify(experts.n_experts, experts.d_in, experts.d_hidden)


def dtype_key(dtype: torch.dtype) -> str:
    """The table's dtype key: ``bfloat16`` for bf16, ``float32`` for everything else."""
    return "bfloat16" if dtype == torch.bfloat16 else "float32"


def cpu_choice(dtype: torch.dtype, experts: GroupedExperts, isa: str | None = None) -> CpuChoice:
    """The table entry for this CPU (``isa``: default :func:`mhmoe.runtime.cpu.cpu_isa`), ``dtype`` and experts."""
    return TABLE[(isa or cpu_isa(), dtype_key(dtype), shape_class(experts))]


# BEGIN TABLE (written by benchmarks/cpu_dispatch.py --table; do not edit by hand)
TABLE: dict[tuple[str, str, str], CpuChoice] = {
    ('amx', 'float32', 'few'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_amx_2t.json, cpu_dispatch_amx_2t_tuned.json, cpu_dispatch_amx_tiny_2t_tuned.json'),
    ('amx', 'float32', 'many'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_amx_2t.json, cpu_dispatch_amx_2t_tuned.json, cpu_dispatch_amx_tiny_2t_tuned.json'),
    ('amx', 'float32', 'small'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_amx_tiny_2t_tuned.json'),
    ('amx', 'float32', 'thin_wide'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_amx_2t.json, cpu_dispatch_amx_2t_tuned.json'),
    ('amx', 'bfloat16', 'few'):
        CpuChoice('fused', 16, -1.0, True,
                  'cpu_dispatch_amx_2t.json, cpu_dispatch_amx_2t_tuned.json, cpu_dispatch_amx_tiny_2t_tuned.json'),
    ('amx', 'bfloat16', 'many'):
        CpuChoice('fused', 16, -1.0, True,
                  'cpu_dispatch_amx_2t.json, cpu_dispatch_amx_2t_tuned.json, cpu_dispatch_amx_tiny_2t_tuned.json'),
    ('amx', 'bfloat16', 'small'):
        CpuChoice('fused', 32, -1.0, True,
                  'cpu_dispatch_amx_tiny_2t_tuned.json'),
    ('amx', 'bfloat16', 'thin_wide'):
        CpuChoice('fused', 32, -1.0, True,
                  'cpu_dispatch_amx_2t.json, cpu_dispatch_amx_2t_tuned.json'),
    ('avx512_bf16', 'float32', 'few'):
        CpuChoice('fused', 16, -1.0, True,
                  'cpu_dispatch_avx512bf16_2t_tuned.json, cpu_dispatch_avx512bf16_tiny_2t_tuned.json'),
    ('avx512_bf16', 'float32', 'many'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_avx512bf16_2t_tuned.json, cpu_dispatch_avx512bf16_tiny_2t_tuned.json'),
    ('avx512_bf16', 'float32', 'small'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_avx512bf16_tiny_2t_tuned.json'),
    ('avx512_bf16', 'float32', 'thin_wide'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_avx512bf16_2t_tuned.json'),
    ('avx512_bf16', 'bfloat16', 'few'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_avx512bf16_2t_tuned.json, cpu_dispatch_avx512bf16_tiny_2t_tuned.json'),
    ('avx512_bf16', 'bfloat16', 'many'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_avx512bf16_2t_tuned.json, cpu_dispatch_avx512bf16_tiny_2t_tuned.json'),
    ('avx512_bf16', 'bfloat16', 'small'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_avx512bf16_tiny_2t_tuned.json'),
    ('avx512_bf16', 'bfloat16', 'thin_wide'):
        CpuChoice('fused', 32, -1.0, True,
                  'cpu_dispatch_avx512bf16_2t_tuned.json'),
    ('avx512', 'float32', 'few'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_avx512_emulated_epyc_2t_tuned.json'),
    ('avx512', 'float32', 'many'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_avx512_emulated_epyc_2t_tuned.json'),
    ('avx512', 'float32', 'small'):
        CpuChoice('fused', 1, -1.0, True,
                  'not measured; as many: cpu_dispatch_avx512_emulated_epyc_2t_tuned.json'),
    ('avx512', 'float32', 'thin_wide'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_avx512_emulated_epyc_2t_tuned.json'),
    ('avx512', 'bfloat16', 'few'):
        CpuChoice('fused', 1, -1.0, True,
                  'as float32 (no native bf16): cpu_dispatch_avx512_emulated_epyc_2t_tuned.json'),
    ('avx512', 'bfloat16', 'many'):
        CpuChoice('fused', 1, -1.0, True,
                  'as float32 (no native bf16): cpu_dispatch_avx512_emulated_epyc_2t_tuned.json'),
    ('avx512', 'bfloat16', 'small'):
        CpuChoice('fused', 1, -1.0, True,
                  'as float32 (no native bf16): not measured; as many: '
                  'cpu_dispatch_avx512_emulated_epyc_2t_tuned.json'),
    ('avx512', 'bfloat16', 'thin_wide'):
        CpuChoice('fused', 1, -1.0, True,
                  'as float32 (no native bf16): cpu_dispatch_avx512_emulated_epyc_2t_tuned.json'),
    ('avx2', 'float32', 'few'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_avx2_emulated_2t_tuned.json, cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('avx2', 'float32', 'many'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_avx2_emulated_2t_tuned.json, cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('avx2', 'float32', 'small'):
        CpuChoice('fused', 1, -1.0, True,
                  'not measured; as many: cpu_dispatch_avx2_emulated_2t_tuned.json, '
                  'cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('avx2', 'float32', 'thin_wide'):
        CpuChoice('fused', 1, -1.0, True,
                  'cpu_dispatch_avx2_emulated_2t_tuned.json, cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('avx2', 'bfloat16', 'few'):
        CpuChoice('fused', 1, -1.0, True,
                  'as float32 (no native bf16): cpu_dispatch_avx2_emulated_2t_tuned.json, '
                  'cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('avx2', 'bfloat16', 'many'):
        CpuChoice('fused', 1, -1.0, True,
                  'as float32 (no native bf16): cpu_dispatch_avx2_emulated_2t_tuned.json, '
                  'cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('avx2', 'bfloat16', 'small'):
        CpuChoice('fused', 1, -1.0, True,
                  'as float32 (no native bf16): not measured; as many: cpu_dispatch_avx2_emulated_2t_tuned.json, '
                  'cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('avx2', 'bfloat16', 'thin_wide'):
        CpuChoice('fused', 1, -1.0, True,
                  'as float32 (no native bf16): cpu_dispatch_avx2_emulated_2t_tuned.json, '
                  'cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('other', 'float32', 'few'):
        CpuChoice('fused', 1, -1.0, True,
                  'not measured; as avx2: cpu_dispatch_avx2_emulated_2t_tuned.json, '
                  'cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('other', 'float32', 'many'):
        CpuChoice('fused', 1, -1.0, True,
                  'not measured; as avx2: cpu_dispatch_avx2_emulated_2t_tuned.json, '
                  'cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('other', 'float32', 'small'):
        CpuChoice('fused', 1, -1.0, True,
                  'not measured; as avx512_bf16: cpu_dispatch_avx512bf16_tiny_2t_tuned.json'),
    ('other', 'float32', 'thin_wide'):
        CpuChoice('fused', 1, -1.0, True,
                  'not measured; as avx2: cpu_dispatch_avx2_emulated_2t_tuned.json, '
                  'cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('other', 'bfloat16', 'few'):
        CpuChoice('fused', 1, -1.0, True,
                  'as float32 (no native bf16): not measured; as avx2: cpu_dispatch_avx2_emulated_2t_tuned.json, '
                  'cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('other', 'bfloat16', 'many'):
        CpuChoice('fused', 1, -1.0, True,
                  'as float32 (no native bf16): not measured; as avx2: cpu_dispatch_avx2_emulated_2t_tuned.json, '
                  'cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
    ('other', 'bfloat16', 'small'):
        CpuChoice('fused', 1, -1.0, True,
                  'as float32 (no native bf16): not measured; as avx512_bf16: '
                  'cpu_dispatch_avx512bf16_tiny_2t_tuned.json'),
    ('other', 'bfloat16', 'thin_wide'):
        CpuChoice('fused', 1, -1.0, True,
                  'as float32 (no native bf16): not measured; as avx2: cpu_dispatch_avx2_emulated_2t_tuned.json, '
                  'cpu_dispatch_avx2_emulated_epyc_2t_tuned.json'),
}
# END TABLE
