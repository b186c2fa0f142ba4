"""FLUX 3 Image Klein's flow transformer: its hyper-parameters (`config`) and the network, its names and its
sanitizer (`transformer`). Pure MLX like the rest of `models/`: the shared pieces (timestep embedding,
modulation, RoPE, attention, checkpointing) are imported from `models/`, never copied."""
