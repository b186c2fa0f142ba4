"""What reads and writes files: every safe write (`files`), safetensors and the hub (`weights`), the prompt
cache (`embedding_cache`), the next model's pages (`readahead`), another VAE or decoder (`vae_source`)."""
