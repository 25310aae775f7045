"""Training the demo models and distilling drafters (see docs/models.md)."""
