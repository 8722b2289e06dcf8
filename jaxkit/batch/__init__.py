"""The batch relation: the plan (global = data-parallel × per-device × K), the growing
schedule, the noise scale and the mixture of sources each batch draws from.

May import: keys, mesh (nothing else of jaxkit; no JAX until a function asks for it).
"""
