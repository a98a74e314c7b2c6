"""Offline tools behind ``python -m trainkit.data``: downloads, checksums, token corpora, shards."""
