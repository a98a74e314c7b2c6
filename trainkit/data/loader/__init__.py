"""The loader stage: one resumable loader that owns the position (order, workers, seeds)."""
