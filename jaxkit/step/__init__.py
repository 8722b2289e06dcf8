"""One optimizer step: the optimizer (MultiSteps or one call a step), the jitted step in
both accumulation modes, and putting state on the mesh.

May import: data, hf, distributed, config, models, batch, keys, mesh, workdir.
"""
