"""LoRA training on klein Base: the `train` command, the trainer, its settings, data, work folder and
adapters. Nothing but `__main__` imports this wing."""
