"""The networks and what only they need: configs, the klein transformer, the FLUX.2 VAE, the Qwen3
text encoder and its tokenizer, RoPE, the reference KV cache, recomputation, quantization. Model
files never read files."""
