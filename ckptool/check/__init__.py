"""check layer."""
