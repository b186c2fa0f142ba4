"""What an image leaves and how it is read back: the record and the files written (`output`), A1111's
habits (`<lora:>` tags, the `parameters` text: `a1111`), an image's record as settings (`rerun`)."""
