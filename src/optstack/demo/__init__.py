"""optstack.demo."""
