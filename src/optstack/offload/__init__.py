"""CPU offload: part of an optimizer stepped on the host (``hybrid``), the copies and their order (``transfers``)."""

from optstack.offload.hybrid import DEFAULT_CHUNK_NUMEL, HybridDeviceOptimizer, offloaded, plan_offload

__all__ = ["DEFAULT_CHUNK_NUMEL", "HybridDeviceOptimizer", "offloaded", "plan_offload"]
