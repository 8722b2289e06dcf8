"""Cloud TPU slices described, not attached: devices to compile for from any machine.

With `libtpu` installed, JAX describes a TPU topology without the hardware
(`jax.experimental.topologies.get_topology_desc`): its devices take a mesh, and the train
step compiles for them as for live ones, so the TPU compiler's own `memory_analysis()` and
`cost_analysis()` answer what fits before a slice is rented. Nothing is allocated or run.

A target is an accelerator type as `gcloud` spells it (`v5litepod-16`, `v4-32`, `v5p-32`,
`v6e-8`; `v5e-16` is taken for v5litepod-16) or a topology (`v5e:4x4`, `v4:2x2x4`). One
table, GENERATIONS, holds what each generation's names mean: what the number in an
accelerator type counts (chips for v5e and v6e; TensorCores for v4 and v5p, whose two
cores per chip JAX sees as one device, so v4-8 is 4 chips), the topology's dimensions (2-D
for v5e and v6e, 3-D for v4 and v5p), chips per host (4; v5e and v6e slices of up to 8
chips are one host) and HBM per chip (v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB).

An accelerator type's topology is the one Cloud TPU gives that many chips: 2-D slices
double the shorter side (1x1, 2x2, 2x4, 4x4, 4x8, ...), 3-D ones the last of the shortest
sides (2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Sequence

import jax
import numpy as np

GiB = 2**30
INSTALL = 'pip install -e ".[tpu-plan]"'  # the extra that brings libtpu


class TargetError(ValueError):
    """A target that is not a TPU slice jaxkit can describe."""


@dataclasses.dataclass(frozen=True)
class Generation:
    name: str  # as topologies spell it: "v5e"
    aliases: tuple[str, ...]  # accelerator-type prefixes: "v5litepod", "v5e"
    device_kind: str  # as JAX reports it
    dims: int  # of the topology
    counts_tensorcores: bool  # the number in an accelerator type counts TensorCores
    tensorcores_per_chip: int
    chips_per_host: int  # hosts of a multi-host slice
    single_host_chips: int  # slices up to this many chips run on one host
    hbm_bytes: int  # per chip
    chip_config: str | None  # libtpu's chip config, as live hosts set it
    max_chips: int  # the largest slice
    # What step_time.py prices a step with (peaks stay in peak.py), per chip.
    hbm_bytes_per_s: float = 0.0
    ici_link_bytes_per_s: float = 0.0  # one way, per link
    ring_from: int = 0  # a torus dimension of at least this many chips wraps around
    dcn_bytes_per_s: float = 0.0  # the host's data-centre network, a chip's share

    def wraps(self, extent: int) -> bool:
        """Whether a torus side of `extent` chips is a ring (wraparound links)."""
        return self.ring_from > 0 and extent >= self.ring_from and extent % self.ring_from == 0

    def accelerator_type(self, chips: int) -> str:
        count = chips * self.tensorcores_per_chip if self.counts_tensorcores else chips
        return f"{self.aliases[0]}-{count}"


# Sources. HBM: the Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4,
# /v5e, /v5p, /v6e: 1,200, 819, 2,765 and 1,640 GB/s per chip). ICI links, one way: the
# scaling book's table ("How to Think About TPUs", jax-ml.github.io/scaling-book/tpus/):
# 4.5e10 B/s on v4 and v5e, 9e10 on v5p and v6e, with wraparound on v5e and v6e only along
# a side of 16 chips (the full pod) and on v4 and v5p along sides that are multiples of 4
# (whole cubes). DCN, a chip's share of its host's NICs: v5e, 2 × 100 Gbps for 8 chips
# (the v5e page: 6.4 Tbps a pod of 256), 3.125e9 B/s; v6e, 4 × 200 Gbps for 8 chips (the
# v6e page: 25.6 Tbps a pod), 1.25e10 B/s; v4 and v5p, 50 Gbps a chip, 6.25e9 B/s (the
# scaling book's figure).
GENERATIONS = {
    g.name: g
    for g in (
        Generation(
            "v4",
            ("v4",),
            "TPU v4",
            3,
            True,
            2,
            4,
            4,
            32 * GiB,
            "megacore",
            2048,
            hbm_bytes_per_s=1.2e12,
            ici_link_bytes_per_s=4.5e10,
            ring_from=4,
            dcn_bytes_per_s=6.25e9,
        ),
        Generation(
            "v5e",
            ("v5litepod", "v5e"),
            "TPU v5 lite",
            2,
            False,
            1,
            4,
            8,
            16 * GiB,
            None,
            256,
            hbm_bytes_per_s=8.19e11,
            ici_link_bytes_per_s=4.5e10,
            ring_from=16,
            dcn_bytes_per_s=3.125e9,
        ),
        Generation(
            "v5p",
            ("v5p",),
            "TPU v5",
            3,
            True,
            2,
            4,
            4,
            95 * GiB,
            None,
            8960,
            hbm_bytes_per_s=2.765e12,
            ici_link_bytes_per_s=9e10,
            ring_from=4,
            dcn_bytes_per_s=6.25e9,
        ),
        Generation(
            "v6e",
            ("v6e",),
            "TPU v6 lite",
            2,
            False,
            1,
            4,
            8,
            32 * GiB,
            None,
            256,
            hbm_bytes_per_s=1.64e12,
            ici_link_bytes_per_s=9e10,
            ring_from=16,
            dcn_bytes_per_s=1.25e10,
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as given
    generation: Generation
    shape: tuple[int, ...]  # the topology, chips along each side
    slices: int = 1  # identical slices joined by the data-centre network (--slices)

    @property
    def topology(self) -> str:
        return f"{self.generation.name}:{'x'.join(map(str, self.shape))}"

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def devices(self) -> int:
        """Chips of all the slices."""
        return self.chips * self.slices

    @property
    def chips_per_host(self) -> int:
        g = self.generation
        return self.chips if self.chips <= g.single_host_chips else g.chips_per_host

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host

    @property
    def host_bounds(self) -> tuple[int, ...]:
        """Chips along each side of one host, in three dimensions, as libtpu takes them."""
        if self.hosts == 1:
            return (*self.shape, 1) if len(self.shape) == 2 else self.shape
        return (2, 2, 1)

    def describe(self) -> str:
        g = self.generation
        several = f"{self.slices} slices of " if self.slices > 1 else ""
        each = " each" if self.slices > 1 else ""
        return (
            f"{several}{self.name} ({self.topology}, {g.accelerator_type(self.chips)}): "
            f"{self.chips} {g.device_kind} chip{'s' * (self.chips > 1)} on {self.hosts} "
            f"host{'s' * (self.hosts > 1)}{each}, {g.hbm_bytes // GiB} GiB HBM a chip"
        )


def standard_shape(dims: int, chips: int) -> tuple[int, ...] | None:
    """The topology Cloud TPU gives `chips` chips, or None where it gives none."""
    if dims == 2 and chips == 1:
        return (1, 1)
    shape = [2, 2] if dims == 2 else [2, 2, 1]
    while math.prod(shape) < chips:
        smallest = min(shape)
        i = max(j for j, n in enumerate(shape) if n == smallest)
        shape[i] *= 2
    return tuple(shape) if math.prod(shape) == chips else None


def valid_names(generation: Generation) -> list[str]:
    names, chips = [], 1
    while chips <= generation.max_chips:
        if standard_shape(generation.dims, chips):
            names.append(generation.accelerator_type(chips))
        chips *= 2
    return names


def _generation(prefix: str, text: str) -> Generation:
    for g in GENERATIONS.values():
        if prefix in (g.name, *g.aliases):
            return g
    raise TargetError(f"--target {text}: unknown TPU generation {prefix!r}; give {known_targets()}")


def known_targets() -> str:
    return (
        "a Cloud TPU accelerator type ("
        + "; ".join(
            f"{', '.join(valid_names(g)[:3])}, ... {valid_names(g)[-1]}"
            for g in GENERATIONS.values()
        )
        + ") or a topology ("
        + ", ".join(
            f"{g.name}:{'x'.join(map(str, standard_shape(g.dims, 16) or ()))}"
            for g in GENERATIONS.values()
        )
        + ")"
    )


def generation_of(device_kind: str) -> Generation | None:
    """The generation whose chips JAX reports as `device_kind`, if the table has it."""
    return next((g for g in GENERATIONS.values() if g.device_kind == device_kind), None)


def parse_target(text: str, slices: int = 1) -> Target:
    """`v5litepod-16`, `v5e-16`, `v4-32`, `v5e:4x4`, `v4:2x2x4` → a Target (of `slices`
    such slices)."""
    if slices < 1:
        raise TargetError(f"--slices {slices}: a plan is for one slice or more")
    return dataclasses.replace(_parse_target(text), slices=slices)


def _parse_target(text: str) -> Target:
    text = text.strip()
    name = text.lower()
    topology = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)*)", name)
    if topology:
        g = _generation(topology.group(1), text)
        shape = tuple(int(n) for n in topology.group(2).split("x"))
        if len(shape) != g.dims or min(shape) < 1:
            example = "x".join(map(str, standard_shape(g.dims, 16) or ()))
            raise TargetError(
                f"--target {text}: a {g.name} topology has {g.dims} sides of at least one "
                f"chip, e.g. {g.name}:{example}"
            )
        if math.prod(shape) > g.max_chips:
            raise TargetError(
                f"--target {text}: {math.prod(shape)} chips; the largest {g.name} slice has "
                f"{g.max_chips}"
            )
        return Target(text, g, shape)
    accelerator = re.fullmatch(r"([a-z0-9]+)-(\d+)", name)
    if not accelerator:
        raise TargetError(f"--target {text}: not {known_targets()}")
    g = _generation(accelerator.group(1), text)
    count = int(accelerator.group(2))
    per_chip = g.tensorcores_per_chip if g.counts_tensorcores else 1
    standard = standard_shape(g.dims, count // per_chip) if count % per_chip == 0 else None
    if standard is None or count // per_chip > g.max_chips:
        raise TargetError(
            f"--target {text}: {g.aliases[0]} slices come as {', '.join(valid_names(g))}"
        )
    return Target(text, g, standard)


def target_devices(target: Target) -> Sequence[jax.Device]:
    """The devices of the described slice, in the order JAX numbers them."""
    if importlib.util.find_spec("libtpu") is None:
        raise TargetError(
            f"--target {target.name} compiles with the TPU compiler, which comes with libtpu: "
            f"{INSTALL} (or pip install libtpu)"
        )
    from jax.experimental import topologies

    # libtpu lets one process at a time hold a TPU (/tmp/libtpu_lockfile); a described
    # slice holds none, so plans may run side by side, and beside a process using a TPU.
    # Off a TPU VM, libtpu warns at length that it cannot look up the VM's accelerator and
    # workers: this process is told that it runs alone, on the slice it describes.
    quiet = {
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": target.generation.accelerator_type(target.chips),
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_WORKER_ID": "0",
    }
    # Only while libtpu starts: left in os.environ, they would tell this process (and every
    # process it starts, e.g. `jaxkit train` from a notebook) that it runs on a TPU VM, and
    # distributed.initialize would try to join a pod.
    added = {key: value for key, value in quiet.items() if key not in os.environ}
    os.environ.update(added)
    options = (
        {"chip_config_name": target.generation.chip_config} if target.generation.chip_config else {}
    )
    try:
        return topologies.get_topology_desc(
            platform="tpu",
            topology_name=target.topology,
            chips_per_host_bounds=target.host_bounds,
            num_slices=target.slices,
            **options,
        ).devices
    except Exception as err:  # JaxRuntimeError: libtpu's own words on a shape it rejects
        slices = f" × {target.slices} slices" if target.slices > 1 else ""
        raise TargetError(
            f"--target {target.name}: JAX cannot describe topology {target.topology}{slices}: "
            f"{str(err).splitlines()[0]}"
        ) from None
    finally:
        for key in added:
            os.environ.pop(key, None)


def batch_shards_per_host(devices: Sequence[jax.Device], sizes: dict[str, int]) -> int:
    """How many of the batch's (data × fsdp) shards the devices of one host hold on the mesh
    of these sizes (the config's mesh section, its slices included): each host loads that
    many per-device batches of rows per micro-step (the most any host holds)."""
    from jaxkit import mesh as mesh_lib

    mesh = mesh_lib.make_mesh(sizes, devices)
    held: dict[int, set[tuple[int, int]]] = {}
    for (d, f, _), device in np.ndenumerate(mesh.devices):
        held.setdefault(device.process_index, set()).add((d, f))
    return max(len(shards) for shards in held.values())
