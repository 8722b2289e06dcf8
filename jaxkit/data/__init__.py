"""Rows from sources: text, token files, digits and synthetic data; `data prepare`, the
tokenizers, the token-file format and the prefetching thread.

May import: hf, config, models, batch, keys, mesh, workdir.
"""
