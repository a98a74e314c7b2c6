"""A user's own research code: a model and a dataset, trained by trainkit's entry point."""
