"""read layer."""
