"""Training: data, losses, the one accelerate loop shared by every method, and entry points."""
