"""LoRA training on klein Base. Around the loop: the `train` command, its settings (and config files),
the data, the work folder and its checkpoints, the memory plan, the samples. The loop itself:
`loop/`. Nothing but `__main__` imports this wing (and `__init__`'s lazy `train_lora`)."""
