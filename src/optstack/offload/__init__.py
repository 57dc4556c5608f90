"""CPU offload: a fraction of an optimizer's tensors stepped on the host (``hybrid.py``), the copies between
device and host memory and their ordering (``transfers.py``)."""

from optstack.offload.hybrid import DEFAULT_CHUNK_NUMEL, HybridDeviceOptimizer, offloaded, plan_offload

__all__ = ["DEFAULT_CHUNK_NUMEL", "HybridDeviceOptimizer", "offloaded", "plan_offload"]
