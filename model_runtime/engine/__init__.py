"""Engines: thin shells that drive the pure schedulers and the torch model."""
