"""Checkpoints: what and when (Checkpointer), how (storages), where (location); readers apart."""
