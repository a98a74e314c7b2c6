"""Checkpoints: the Checkpointer (what, when) and its storages (how, where): files, directories."""
