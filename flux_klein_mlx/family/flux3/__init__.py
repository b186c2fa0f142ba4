"""FLUX 3 Image Klein (distilled, Base): everything that names this family outside its networks."""
