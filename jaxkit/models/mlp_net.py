"""The MLP classifier (model.kind="mlp") in flax NNX: ReLU layers of model.hidden_size
units, params annotated with their partitioning (mesh.RULES).

Shape legend: B batch rows, I input features, C classes.
"""

from __future__ import annotations

import itertools

import jax
from flax import nnx

from jaxkit.mesh import constrain
from jaxkit.models import layers

_linear = layers.linear


class MLPClassifier(nnx.Module):
    def __init__(
        self,
        num_features: int,
        hidden_size: int,
        num_layers: int,
        num_classes: int,
        *,
        rngs: nnx.Rngs,
    ):
        widths = [num_features] + [hidden_size] * num_layers
        # Alternate in/out roles so consecutive kernels shard compatibly on the tensor axis.
        roles = [("in_proj", "hidden_bias"), ("out_proj", "vector")]
        self.hidden = nnx.List(
            [
                _linear(d_in, d_out, *roles[i % 2], rngs=rngs)
                for i, (d_in, d_out) in enumerate(itertools.pairwise(widths))
            ]
        )
        self.head = _linear(hidden_size, num_classes, "logits", "vector", rngs=rngs)

    def __call__(self, x_BxI: jax.Array) -> jax.Array:
        h = constrain(x_BxI, "batch", None)
        for i, layer in enumerate(self.hidden):
            # Alternate in/out roles: in_proj outputs are hidden units (tensor-sharded).
            h = constrain(jax.nn.relu(layer(h)), "batch", "mlp" if i % 2 == 0 else None)
        return constrain(self.head(h), "batch", None)  # logits_BxC
