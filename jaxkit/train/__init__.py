"""A run: the training loop and its pieces, resuming, checkpoints and the workdir lock.

May import: records and everything below it.
"""
