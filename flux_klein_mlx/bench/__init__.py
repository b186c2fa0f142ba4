"""The `benchmark` command: per-stage latency against physics (FLOPs), cold time-to-image, random
full-size models. Nothing but `__main__` (and `benchmarks/`) imports this wing."""
