"""Writes tests/data/lm_before_sections: a workdir of the code before the typed config sections
(a transformer LM on synthetic tokens, tiny, 1 device, K = 2), stopped after optimizer step 2
of 4. Run from a checkout of that code (d023862): python make.py OUT, with
tests/test_checkpoint.py's LM_BEFORE_SECTIONS overrides."""

import sys

import jax
from jaxkit.loop import train

from jaxkit.config import apply_overrides, load_config

config = load_config("lm_tiny")
apply_overrides(config, sys.argv[2:])  # LM_BEFORE_SECTIONS
r = train(config, sys.argv[1], devices=jax.devices()[:1], progress=False, stop_after_micro_steps=4)
print(r.stopped, int(r.state.step))
