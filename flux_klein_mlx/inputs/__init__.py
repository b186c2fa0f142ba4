"""A run's inputs, read and checked before any model runs: its settings (`settings`: `RunSettings` ->
`PreparedInputs`), its images (references, the init image, the mask), outpainting's canvas and pads, and
an image's record read back as settings (`rerun`: `generate --from`, untrusted)."""
