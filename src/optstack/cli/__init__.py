"""optstack.cli."""
