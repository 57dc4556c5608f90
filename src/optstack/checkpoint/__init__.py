"""optstack.checkpoint."""
