"""Hugging Face Llama-family checkpoints: their tensor names and config.json, as jaxkit's
Llama (model.kind="llama") names and configures them (names.py); a run started from one
(model.init_from, load.py; train/resume.py builds the state) and written back as one
(`jaxkit export --hf`, generate/hf_export.py).

May import: config, models, batch, keys, mesh, workdir.
"""
