"""FLUX.2 [klein] 4B / 9B (distilled, Base, 9B-KV): everything that names this family outside its networks."""
