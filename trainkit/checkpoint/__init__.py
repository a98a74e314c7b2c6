"""Checkpoints: the Checkpointer (what, when), its storages (how: one file, DCP shards) and their
location (where: a disk, a store; :mod:`~trainkit.checkpoint.location`); apart from these
writers, the after-training readers (select, load, export, text_export), which no writer
imports."""
