"""Writes tests/data/multisteps_mid_step: a workdir of the code before states dropped the
accumulator (mlp_digits, tiny, 1 device, K = 2), stopped 1 micro-step into step 2."""

import sys

import jax
from jaxkit.loop import train

from jaxkit.config import apply_overrides, load_config

config = load_config("mlp_digits")
apply_overrides(
    config,
    [
        "model.hidden_size=8",
        "model.num_layers=1",
        "batch.global_batch_size=8",
        "batch.per_device_batch_size=4",
        "train.steps=3",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every=0",
        "train.noise_scale_every=0",
    ],
)
r = train(config, sys.argv[1], devices=jax.devices()[:1], progress=False, stop_after_micro_steps=3)
print(r.stopped, int(r.state.opt_state.mini_step), int(r.state.step))
