"""FLUX.2 [klein]'s own networks (its transformer), built on the shared pieces of `models/`."""
