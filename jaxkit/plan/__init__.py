"""What a split costs before it runs: planning, compiled memory and FLOPs, HLO reading and
its traffic, predicted step times, chip peaks, TPU targets and the compile cache.

May import: step, data, hf, distributed, config, models, batch, keys, mesh, workdir.
"""
