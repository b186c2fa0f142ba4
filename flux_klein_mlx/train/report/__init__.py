"""What a run reports: its events and metrics log (floor 1), validation and the EMA, samples (floor 4)."""
