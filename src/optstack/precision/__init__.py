"""optstack.precision."""
