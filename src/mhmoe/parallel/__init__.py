"""Scale-out on PyTorch's own stack, applied from outside the model: torchrun + torch.distributed
(NCCL/gloo), DDP, FSDP2 (``fully_shard``), a 2-D ``("dp", "ep")`` DeviceMesh, expert parallelism with
``all_to_all_single`` and ``torch.distributed.checkpoint`` (DCP). See docs/DISTRIBUTED.md.

Modules: :mod:`.env` (process group, mesh), :mod:`.expert_parallel` (EP MoE layers),
:mod:`.data_parallel` (DDP / FSDP2 wrapping, gradient sync and clipping), :mod:`.checkpoint` (DCP),
:mod:`.launch` (the trainer's parallelism under torchrun, :func:`train_parallel`).
"""

from mhmoe.parallel.launch import Distributed, parallel_mode, train_parallel

__all__ = ["Distributed", "parallel_mode", "train_parallel"]
