"""optstack.algorithms."""
