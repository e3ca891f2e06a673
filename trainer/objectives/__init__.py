"""objectives."""
