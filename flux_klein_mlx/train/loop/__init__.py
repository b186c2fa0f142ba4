"""The training loop: the objective and the steps (trainer), the adapters it trains, the learning-rate
schedule, EMA and validation (evaluation), and the ranks of a run under mlx.launch (distributed)."""
