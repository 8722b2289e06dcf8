"""Hugging Face Llama-family checkpoints: their tensor names and config.json, as jaxkit's
Llama (model.kind="llama") names and configures them (names.py); a run started from one
(model.init_from, load.py) and written back as one (`jaxkit export --hf`, export.py)."""
