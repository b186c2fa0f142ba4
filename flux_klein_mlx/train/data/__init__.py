"""A run's data: the images and captions (`dataset`, floor 1) and their caches (`captions`, `latents`, floor 4)."""
