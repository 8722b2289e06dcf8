"""Hugging Face Llama-family checkpoints: their tensor names and config.json, as jaxkit's
Llama (model.kind="llama") names and configures them (names.py)."""
