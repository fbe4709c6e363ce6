"""Scale-out on PyTorch's own stack: torchrun + torch.distributed (NCCL/gloo), DDP, FSDP2
(``fully_shard``), a 2-D ``("dp", "ep")`` DeviceMesh, expert parallelism with ``all_to_all_single``
and ``torch.distributed.checkpoint`` (DCP). Model code stays single-device; everything here is applied
from outside (see docs/DISTRIBUTED.md).

Modules: :mod:`.env` (process group, mesh), :mod:`.expert_parallel` (EP MoE layers),
:mod:`.data_parallel` (DDP / FSDP2 wrapping, gradient sync and clipping), :mod:`.checkpoint` (DCP).
Import them directly; this package imports nothing heavy.
"""
