"""What an image leaves: the record and the files written (`output`), A1111's habits (`<lora:>` tags,
the `parameters` text, the model hash: `a1111`). `inputs/rerun` reads a record back as settings."""
