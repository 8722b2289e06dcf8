"""jaxkit: sharded JAX training where the global batch relation is a first-class object.

global_batch = data_parallel_size × per_device_batch × grad_accum_steps
"""

__version__ = "0.1.0"
