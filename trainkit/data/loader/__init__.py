"""The loader stage: one resumable loader, any pass from a caller's position (order, workers)."""
