"""One training step's pieces, pure (floor 1): the objective, the optimizers, the adapters, data parallelism."""
