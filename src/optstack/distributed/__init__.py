"""optstack.distributed."""
