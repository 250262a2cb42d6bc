"""transition."""
