"""The Hydra entry point's parts: one-line errors, run directory, config folders, cli."""
