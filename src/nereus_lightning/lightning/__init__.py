"""lightning."""
