"""Checkpoints that lose nothing, with orbax-checkpoint.

A checkpoint is keyed by optimizer steps done: `checkpoints/step_N/`. The key only grows,
whatever the device count or accumulation of the run that wrote it, so the newest
checkpoint is always the furthest the run got. It holds the whole train state (params, the
MultiSteps accumulator and counters, the inner optimizer state) plus a JSON record of the
config, the batch plan and the host-side loop state, including the data position (examples
consumed) and, for a save between optimizer steps (on SIGTERM), the micro-steps of the next
step already in the accumulator. The only randomness is the config's seed (model init and
data order), which the saved config carries; no iterator state and no topology is saved.

A mid-step checkpoint also holds the state of the last optimizer-step boundary: MultiSteps
changes params and the inner optimizer state only at a step's last micro-batch, so the
boundary state is the saved one with the accumulator emptied. A resume that cannot continue
the accumulation (another K, another micro-batch size, fused mode) restarts that step from
its first micro-batch, which is exact.

A state holds MultiSteps' accumulator only where the run needs one between calls (MultiSteps
mode at K > 1; optimizer.holds_accumulator). A checkpoint is read back in the layout it was
written in and then fitted to the run's: at a step boundary the accumulator holds zeros, so
a run that keeps one gets zeros, and a run that keeps none drops it (a half-filled one is
first emptied by the restart above, which such a run always needs).

Saves are asynchronous; orbax writes each into a temporary directory and renames it when
complete, so a crash or `kill -9` at any moment leaves either a whole checkpoint or a
temporary one that is ignored and cleaned up, never loaded.

Workdirs written before this numbering keyed checkpoints by micro-step (`checkpoints/N/`,
no prefix). They are still read: when there is no `step_N` checkpoint, the most advanced
of them (by the optimizer step in its record, not by its number) is resumed, and the run
saves `step_N` checkpoints from there on, leaving the old directories untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxkit.batch.mixture import stage_changes
from jaxkit.batch.plan import Accumulation
from jaxkit.batch.schedule import Position
from jaxkit.config import ADDED_DEFAULTS, flatten, resumable, saved_run_config
from jaxkit.sections import RunConfig
from jaxkit.step.train_step import abstract_params, abstract_state, accumulator_layout
from jaxkit.workdir import absolute, missing_gcs_support

# checkpoints/step_N: N optimizer steps done. Older workdirs hold checkpoints/M, M micro-steps.
STEP_PREFIX = "step"
# Written into every checkpoint's record; a record without it comes from the micro-step
# numbering.
FORMAT = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from as asked."""


@dataclasses.dataclass
class Restored:
    position: Position  # where the run continues
    state: Any  # the TrainState, placed with the target shardings
    meta: dict  # {"config", "plan", "loop"}: as saved, loop["step"/"micro"/"examples_seen"]
    redone_micro_steps: int = 0  # a saved half-step that this plan cannot continue


def _names(path: tuple) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def config_conflicts(
    saved: dict,
    current: dict,
    saved_paths: dict | None = None,
    current_paths: dict | None = None,
) -> list[str]:
    """Lines `key: saved -> current` for every difference that would change the model.

    A key that names an input (data.path) is compared as the absolute location it named
    where each run started (`saved_paths`, `current_paths`: data.input_paths), so the same
    directory written from another working directory is no change, and the same relative
    string naming another directory is one. A checkpoint that recorded no location (saved
    before runs did) has its strings compared."""
    # Runs saved before a key existed ran with its default.
    old, new = ADDED_DEFAULTS | flatten(saved), ADDED_DEFAULTS | flatten(current)
    saved_paths, current_paths = saved_paths or {}, current_paths or {}
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if resumable(key):
            continue
        was, now = old.get(key, "<absent>"), new.get(key, "<absent>")
        if key in saved_paths and key in current_paths:
            if saved_paths[key] != current_paths[key]:
                lines.append(
                    f"  {key}: {was!r} (saved, {saved_paths[key]}) -> {now!r} "
                    f"({current_paths[key]})"
                )
            continue
        if was != now:
            lines.append(f"  {key}: {was!r} (saved) -> {now!r}")
    return lines


# The key of data facts (see data.data_facts) that names the tokens, not only their rows.
FINGERPRINT = "fingerprint"
# The key of data facts that says where their tokenizer lies (data.TOKENIZER): a record for
# an export, not what the data is, so never compared.
_TOKENIZER = "tokenizer"
# The key of data facts that records where the config's input paths lie (data.PATHS): held
# against the config's keys (config_conflicts), not compared as facts of the data.
_PATHS = "paths"
# The key of data facts that records a mixture's stages (data.MIXTURE_STAGES): compared only
# up to the saved position (mixture.stage_changes), so a resume may add a later stage.
_MIXTURE_STAGES = "mixture_stages"


def data_changes(saved: dict | None, current: dict | None) -> list[str]:
    """Lines `key saved (saved) -> current` for each way the data a checkpoint recorded
    differ from this run's: rows per split and, where both have one, each fingerprint
    entry. A checkpoint saved without a fingerprint is checked on its rows alone."""
    if saved is None or current is None:
        return []
    both = FINGERPRINT in saved and FINGERPRINT in current

    def facts(data: dict) -> dict[str, object]:
        skip = (FINGERPRINT, _TOKENIZER, _PATHS, _MIXTURE_STAGES)
        rows = {k: v for k, v in data.items() if k not in skip}
        return rows | (flatten(data[FINGERPRINT]) if both else {})

    old, new = facts(saved), facts(current)
    return [
        f"  {key} {old.get(key, '<absent>')!r} (saved) -> {new.get(key, '<absent>')!r}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    ]


def position_of(meta: dict) -> Position:
    loop = meta["loop"]
    return Position(
        step=int(loop["step"]), examples=int(loop["examples_seen"]), micro=int(loop["micro"])
    )


def _from_micro_step_numbering(micro_step: int, meta: dict) -> dict:
    """The record of a checkpoint saved under the micro-step numbering, in today's terms.

    That code read optimizer step i's rows at i × (its global batch), so that is where the
    data position of the saved step lies.
    """
    plan = meta["plan"]
    step, micro = divmod(micro_step, plan["grad_accum_steps"])
    loop = dict(meta["loop"], step=step, micro=micro, legacy_micro_steps=micro_step)
    loop["examples_seen"] = step * plan["global_batch_size"]
    return dict(meta, loop=loop, format=FORMAT, legacy_name=str(micro_step))


# Orbax shares the save of a replicated array out over its replicas, each writing a slice,
# and compiles a slicing program per array and device for it: 64 for the tiny LM's params on
# 8 devices, about 1.2 s of CPU in every new process (measured: 3.9-5.3 s against 2.9-3.6 s
# for a 3-step run that saves each step), for arrays whose whole write takes microseconds.
# Slices smaller than this are written whole by one replica instead: the same files, and an
# array of a real model (MiBs per slice) is still shared out.
REPLICA_PARALLEL_MIN_BYTES = 2**20


@functools.cache
def _small_arrays_saved_whole() -> None:
    """Sets REPLICA_PARALLEL_MIN_BYTES on orbax's handler of jax.Array, once per process;
    a handler registered by the user (not orbax's own as it comes) is left as it is."""
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    if type(handler) is ocp.type_handlers.ArrayHandler and not getattr(
        handler, "_min_slice_bytes_for_replica_parallel", None
    ):
        absl = logging.getLogger("absl")  # orbax warns of any override, on every process
        level = absl.level
        absl.setLevel(logging.ERROR)
        try:
            ocp.type_handlers.register_type_handler(
                jax.Array,
                ocp.type_handlers.ArrayHandler(
                    min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES
                ),
                override=True,
            )
        finally:
            absl.setLevel(level)


def _manager(directory: Any, **options: Any) -> ocp.CheckpointManager:
    _small_arrays_saved_whole()
    return ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(**options),
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        },
    )


class Checkpointer:
    """Saves and restores train states under WORKDIR/checkpoints/, a local path or a URL.

    On gs://, orbax writes through tensorstore's GCS driver and, since a rename there is a
    copy, marks a whole save with a commit file instead of renaming a temporary directory.
    """

    def __init__(self, directory: str | os.PathLike, keep: int, warn: Callable[[str], None]):
        missing = missing_gcs_support(directory)
        if missing:
            raise CheckpointError(missing)
        if keep < 1:  # orbax would keep nothing, and a rerun would start over
            raise CheckpointError(f"checkpoint.keep={keep} must be at least 1")
        # An epath.Path: orbax picks its GCS code paths from a "gs://" prefix, which a
        # pathlib.Path would have turned into a local "gs:/" directory.
        self.directory = absolute(directory)
        self.warn = warn
        self.manager = _manager(
            self.directory,
            max_to_keep=keep,
            create=True,
            cleanup_tmp_directories=True,  # what a killed save left behind
            enable_async_checkpointing=True,
            step_prefix=STEP_PREFIX,
        )
        self.blocking_s = 0.0  # time the training loop spent inside save()
        self.saves = 0

    def steps(self) -> list[int]:
        """Optimizer steps with a checkpoint."""
        return sorted(self.manager.all_steps())

    def save(self, position: Position, state: Any, meta: dict, *, wait: bool = False) -> bool:
        """Starts an async save at `position`; `wait` blocks until it is on disk.

        Returns False, saving nothing, when a checkpoint of that optimizer step is there
        already: a stop in the middle of the step after it. That checkpoint is at or before
        `position`, and resuming from it redoes the micro-steps since, exactly.
        """
        if position.step in self.manager.all_steps():
            return False
        start = time.perf_counter()
        record = dict(meta, format=FORMAT)
        self.manager.save(
            position.step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(record)
            ),
            force=True,
        )
        self.blocking_s += time.perf_counter() - start
        self.saves += 1
        if wait:
            self.manager.wait_until_finished()
        return True

    def read_meta(self, step: int) -> dict:
        return _read_meta(self.manager, step)

    def restore(self, step: int, abstract_state: Any) -> Any:
        """The state saved at optimizer step `step`, placed as `abstract_state` says, with
        an accumulator where the checkpoint holds one (see `fitted`)."""
        saved = self.manager.item_metadata(step)["state"]
        return _restore(
            self.manager, step, accumulator_layout(abstract_state, _holds_accumulator(saved))
        )

    def micro_step_numbered(self) -> ocp.CheckpointManager | None:
        """The checkpoints of a workdir written under the micro-step numbering, if any."""
        manager = _manager(self.directory, create=False)
        return manager if manager.all_steps() else None

    def restore_latest(
        self, abstract_state: Any, check: Callable[[dict], None]
    ) -> tuple[Any, dict] | None:
        """(state, record) of the newest checkpoint that reads back whole, or None.

        `check(record)` runs before anything is restored and may refuse (raise); a
        checkpoint whose arrays do not fit `abstract_state` is refused too. Only a
        checkpoint that fails to read is set aside (with a warning naming it) for the one
        before it.
        """
        candidates = [(self.manager, step, None) for step in reversed(self.steps())]
        old = None if candidates else self.micro_step_numbered()
        if old is not None:
            candidates = self._by_progress(old)
        for manager, step, legacy_meta in candidates:
            name = self._name(manager, step)
            try:
                meta = legacy_meta or _read_meta(manager, step)
                saved = manager.item_metadata(step)["state"]
            except Exception as err:  # whatever fails to read is unusable
                self._set_aside(manager, step, err)
                continue
            check(meta)
            wanted = accumulator_layout(abstract_state, _holds_accumulator(saved))
            self._check_shapes(name, saved, wanted)
            try:
                state = _restore(manager, step, wanted)
            except Exception as err:  # a torn or corrupted checkpoint
                self._set_aside(manager, step, err)
                continue
            return state, meta
        return None

    def _by_progress(self, old: ocp.CheckpointManager) -> list:
        """Micro-step-numbered checkpoints, most advanced first by their own records: a
        resume on fewer accumulation steps gave later saves smaller numbers."""
        found = []
        for micro_step in old.all_steps():
            try:
                meta = _from_micro_step_numbering(micro_step, _read_meta(old, micro_step))
            except Exception as err:
                self._set_aside(old, micro_step, err)
                continue
            found.append((position_of(meta), micro_step, meta))
        found.sort(key=lambda f: (f[0].step, f[0].micro), reverse=True)
        return [(old, micro_step, meta) for _, micro_step, meta in found]

    def _name(self, manager: ocp.CheckpointManager, step: int) -> str:
        return f"step_{step}" if manager is self.manager else str(step)

    def _check_shapes(self, name: str, saved: Any, abstract_state: Any) -> None:
        # Orbax stores every container as a dict with string keys: compare by key names.
        saved_leaves = {
            _names(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]
        }
        wanted = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
        problems = []
        for path, leaf in wanted:
            have = saved_leaves.get(_names(path))
            if have is None:
                problems.append(f"  {'.'.join(_names(path))}: not in the checkpoint")
            elif tuple(have.shape) != tuple(leaf.shape):
                problems.append(
                    f"  {'.'.join(_names(path))}: saved {tuple(have.shape)}, "
                    f"model wants {tuple(leaf.shape)}"
                )
        if problems or len(saved_leaves) != len(wanted):
            # MultiSteps' accumulator mirrors the params (and a run may not even keep one):
            # named only where nothing else differs.
            shown = [p for p in problems if not p.startswith("  opt_state.acc_grads.")]
            shown = shown or problems
            more = [f"  and {len(shown) - 10} more"] if len(shown) > 10 else []
            raise CheckpointError(
                f"the checkpoint {name} in {self.directory} was written by a different "
                "model:\n" + "\n".join(shown[:10] + more or ["  (different tree)"])
            )

    def _set_aside(self, manager: ocp.CheckpointManager, step: int, err: Exception) -> None:
        name = self._name(manager, step)
        aside, n = self.directory / f"{name}.unreadable", 1
        while aside.exists():  # set aside before: keep both
            n += 1
            aside = self.directory / f"{name}.unreadable-{n}"
        self.warn(
            f"warning: checkpoint {name} is unreadable "
            f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); moved to {aside.name}, "
            "falling back to the one before it"
        )
        if jax.process_index() == 0:
            (self.directory / name).rename(aside)
        manager.reload()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _holds_accumulator(saved: Any) -> bool:
    """Whether a checkpoint's state (its metadata tree) holds MultiSteps' accumulator."""
    paths = jax.tree_util.tree_flatten_with_path(saved)[0]
    return any(_names(path)[:2] == ("opt_state", "acc_grads") for path, _ in paths)


def fitted(state: Any, position: Position, setup: Any) -> Any:
    """A restored state in the layout of `setup`'s: an accumulator of zeros added where
    the run keeps one and the checkpoint had none; one dropped where the run keeps none,
    only at a step boundary, where it holds zeros (a half-step is emptied before this)."""
    ms, wanted = state.opt_state, setup.state_shardings.opt_state.acc_grads
    if (ms.acc_grads is None) == (wanted is None):
        return state
    if wanted is None:
        if position.micro:
            raise CheckpointError(
                f"the checkpoint holds {position.micro} micro-steps of optimizer step "
                f"{position.step + 1}, which a run of one call per step cannot continue"
            )
        return state.replace(opt_state=ms._replace(acc_grads=None))
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), state.params)
    zeros = jax.jit(
        lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), out_shardings=wanted
    )()
    return state.replace(opt_state=ms._replace(acc_grads=zeros))


def _read_meta(manager: ocp.CheckpointManager, step: int) -> dict:
    restored = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return dict(restored.meta)


def _restore(manager: ocp.CheckpointManager, step: int, abstract_state: Any) -> Any:
    restored = manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
    )
    return restored.state


def saved_steps(directory: str | os.PathLike) -> list[int]:
    """The optimizer steps with a checkpoint in `directory` (WORKDIR/checkpoints), read
    without touching it: no temporary directory of a save in flight is cleaned up."""
    if not absolute(directory).exists():
        return []
    return sorted(_manager(absolute(directory), create=False, step_prefix=STEP_PREFIX).all_steps())


def restore_params(
    directory: str | os.PathLike, step: int, shardings: Any = None
) -> tuple[Any, dict]:
    """(params, record) of the checkpoint at optimizer step `step`, the params alone (not
    the optimizer state) as host-readable arrays on one CPU device, shaped as the record's
    config builds them; or, with `shardings` (a tree like the params), placed as they say
    (each device reads its own slices: `jaxkit sample` lays them out as the run trained)."""
    # The state's own handler restores whole trees only; the PyTree one it wraps reads the
    # same files and can leave the optimizer state on disk.
    manager = ocp.CheckpointManager(
        absolute(directory),
        options=ocp.CheckpointManagerOptions(create=False, step_prefix=STEP_PREFIX),
        item_handlers={
            "state": ocp.PyTreeCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        },
    )
    meta = _read_meta(manager, step)
    one = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    abstract = abstract_params(saved_run_config(meta["config"]))
    if shardings is None:
        shardings = jax.tree.map(lambda _: one, abstract)
    wanted = jax.tree.map(
        lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        abstract,
        shardings,
    )
    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), wanted)
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                {"params": wanted}, restore_args={"params": restore_args}, partial_restore=True
            )
        ),
    )
    return restored.state["params"], meta


def plans_side_by_side(old: dict, new: dict) -> str:
    keys = [
        "mesh_shape",
        "data_parallel_size",
        "per_device_batch_size",
        "grad_accum_steps",
        "global_batch_size",
        "micro_batch_size",
        "tokens_per_step",
        "learning_rate",
    ]
    rows = [(k, _short(old.get(k)), _short(new.get(k))) for k in keys]
    width = [max(len(r[i]) for r in [("", "saved plan", "new plan"), *rows]) for i in range(3)]
    lines = [
        " | ".join(c.ljust(w) for c, w in zip(row, width, strict=True)).rstrip()
        for row in [("", "saved plan", "new plan"), *rows]
    ]
    lines.insert(1, "-+-".join("-" * w for w in width))
    return "\n".join(lines)


def _short(value: object) -> str:
    if isinstance(value, dict):
        return "×".join(str(v) for v in value.values())
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _length(config: dict) -> tuple[str, int]:
    """A run's length as its config says it: ("train.steps", N) or ("train.examples", N)."""
    t = config["train"]
    if t.get("steps") is not None:
        return "train.steps", int(t["steps"])
    return "train.examples", int(t["examples"])


def _check_length(
    saved_config: dict, position: Position, current: dict, allow_longer: bool
) -> None:
    """train.steps (or train.examples) may change on a workdir only upwards, when asked."""
    (key, saved), (wanted_key, wanted) = _length(saved_config), _length(current)
    unit = key.split(".")[1]  # steps | examples
    done = position.step if key == "train.steps" else position.examples
    if wanted_key != key:
        raise CheckpointError(
            f"this workdir holds a run of {key}={saved}; it cannot be measured in "
            f"{wanted_key} instead. Use {key}={saved} (and {wanted_key}=null), or a new --workdir."
        )
    if wanted == saved:
        return
    if wanted < saved:
        raise CheckpointError(
            f"{key}: {saved} (saved) -> {wanted}: a run cannot be shortened (its "
            f"learning-rate schedule is laid over {saved} {unit}, {done} done). Use "
            f"{key}={saved}, or a new --workdir."
        )
    if not allow_longer:
        finished = "finished " if done >= saved else ""
        raise CheckpointError(
            f"{key}: {saved} (saved) -> {wanted}: this workdir holds a {finished}run "
            f"of {saved} {unit} ({done} done). Pass --allow-longer to extend it to {wanted} "
            "(the learning-rate schedule is then re-laid over the new length from the step "
            f"it resumes at), or use {key}={saved}."
        )


def can_continue_accumulation(saved_plan: dict, plan: Any, accumulation: Accumulation) -> bool:
    """Whether a half-filled accumulator from `saved_plan` can take this plan's micro-batches:
    the same rows per micro-step and the same K, and one micro-batch per call."""
    return (
        accumulation is Accumulation.MULTISTEPS
        and saved_plan["grad_accum_steps"] == plan.grad_accum_steps
        and saved_plan["micro_batch_size"] == plan.micro_batch_size
    )


def resume(
    checkpointer: Checkpointer,
    setup: Any,
    config: RunConfig,
    plan_at: Callable[[dict], Any],
    *,
    saved_as: dict,
    allow_batch_change: bool = False,
    allow_longer: bool = False,
    echo: Callable[[str], None] = print,
    data: dict | None = None,
) -> Restored | None:
    """Restores the latest checkpoint onto this run's mesh and plan, or None to start fresh.

    The global batch is what must not change silently: the config's free batch field is
    re-derived for the new mesh, so grad_accum_steps (or per_device_batch_size) absorbs a
    change of device count. A changed global batch is refused unless `allow_batch_change`,
    a changed train.steps unless it grows and `allow_longer`. `plan_at(meta)` is this run's
    plan at a checkpoint's position (a batch schedule's stage there). `data` (rows of
    each split and, for token files, their fingerprint) must match what the checkpoint
    saw, where it recorded it; the config is compared first, as the run saves it
    (`saved_as`: its config.json, the keys as the config gives them).
    """
    if not checkpointer.steps() and checkpointer.micro_step_numbered() is None:
        return None  # a new workdir
    check = functools.partial(
        _check_resumable,
        checkpointer=checkpointer,
        config=config,
        current=saved_as,
        plan_at=plan_at,
        data=data,
        allow_batch_change=allow_batch_change,
        allow_longer=allow_longer,
    )
    found = checkpointer.restore_latest(abstract_state(setup), check)
    if found is None:
        echo("warning: no readable checkpoint left; starting from scratch")
        return None
    state, meta = found
    if data is not None and FINGERPRINT in data and FINGERPRINT not in (meta.get("data") or {}):
        echo(
            f"warning: the checkpoint at optimizer step {position_of(meta).step} in "
            f"{checkpointer.directory} records no fingerprint of its token data (an earlier "
            "jaxkit saved it): only the row counts were checked; make sure data.path holds "
            "the tokens it was trained on"
        )
    position, plan = position_of(meta), plan_at(meta)
    _echo_resumed(checkpointer, meta, position, plan, echo)
    state, position, redone = _restart_half_step(state, position, meta["plan"], plan, setup, echo)
    state = fitted(state, position, setup)
    return Restored(position=position, state=state, meta=meta, redone_micro_steps=redone)


def _check_resumable(
    meta: dict,
    *,
    checkpointer: Checkpointer,
    config: RunConfig,
    current: dict,
    plan_at: Callable[[dict], Any],
    data: dict | None,
    allow_batch_change: bool,
    allow_longer: bool,
) -> None:
    """Refuses a checkpoint this run cannot continue, before anything is restored: the
    config first (another model or data source reads other data too, and the config's
    differences say why), then the data, the run's length and the global batch."""
    _check_same_run(meta, checkpointer, current, data)
    _check_length(meta["config"], position_of(meta), current, allow_longer)
    _check_global_batch(meta, config, plan_at(meta), allow_batch_change)


def _check_same_run(
    meta: dict, checkpointer: Checkpointer, current: dict, data: dict | None
) -> None:
    """The saved run trained the same model on the same data, or resuming means nothing."""
    conflicts = config_conflicts(
        meta["config"],
        current,
        (meta.get("data") or {}).get(_PATHS),
        (data or {}).get(_PATHS),
    )
    if conflicts:
        raise CheckpointError(
            f"{checkpointer.directory.parent} holds a run with a different config; "
            "resuming would train a different model:\n"
            + "\n".join(conflicts)
            + (
                "\nmodel.scan_layers stacks the blocks' params on a layer axis: a "
                "checkpoint of one layout does not load into the other."
                if any("model.scan_layers" in line for line in conflicts)
                else ""
            )
            + "\nUse the saved values, or a new --workdir."
        )
    changes = data_changes(meta.get("data"), data)
    at, plan = position_of(meta), meta["plan"]
    changes += stage_changes(
        (meta.get("data") or {}).get(_MIXTURE_STAGES),
        (data or {}).get(_MIXTURE_STAGES),
        # the rows trained on: a mid-step save's accumulator holds its micro-batches' too
        at.examples + at.micro * plan["global_batch_size"] // plan["grad_accum_steps"],
    )
    if changes:
        raise CheckpointError(
            f"{checkpointer.directory.parent} was trained on other data; its saved data "
            "position would read other rows:\n"
            + "\n".join(changes)
            + "\nRestore the data the run was trained on, or use a new --workdir."
        )


def _check_global_batch(meta: dict, config: RunConfig, plan: Any, allow_batch_change: bool) -> None:
    """The global batch may change at a resume only when asked: it trains another model."""
    old = meta["plan"]
    new_plan = plan.to_json()
    if old["global_batch_size"] != plan.global_batch_size and not allow_batch_change:
        raise CheckpointError(
            f"resuming here changes the global batch from {old['global_batch_size']} to "
            f"{plan.global_batch_size}, which trains a different model:\n"
            + plans_side_by_side(old, new_plan)
            + (
                "\nbatch.schedule gives a different global batch at this example: keep its "
                "stages up to here (change only later ones)"
                if config.batch.schedule
                else "\nLeave one of batch.per_device_batch_size / batch.grad_accum_steps "
                "free (null) so it is re-derived"
            )
            + ", or pass --allow-batch-change to accept it (the learning rate then follows "
            f"optimizer.lr_scaling={plan.lr_scaling!r})."
        )


def _echo_resumed(
    checkpointer: Checkpointer,
    meta: dict,
    position: Position,
    plan: Any,
    echo: Callable[[str], None],
) -> None:
    """Says where the run resumes and, where the plan changed, how: a changed split or
    batch is visible in the log, not only in the numbers."""
    old, new_plan = meta["plan"], plan.to_json()
    where = f"optimizer step {position.step}"
    if position.micro:
        where += f", {position.micro} of {old['grad_accum_steps']} micro-steps into the next"
    source = meta.get("legacy_name")
    echo(
        f"resuming from {checkpointer.directory} at {where}"
        + (f" (checkpoint {source}, numbered by micro-step by an earlier jaxkit)" if source else "")
    )
    if any(
        old[k] != new_plan[k]
        for k in ("mesh_shape", "per_device_batch_size", "grad_accum_steps", "global_batch_size")
    ):
        echo(plans_side_by_side(old, new_plan))
    if old["global_batch_size"] != plan.global_batch_size:
        echo(
            f"global batch {old['global_batch_size']} -> {plan.global_batch_size} "
            f"(--allow-batch-change): learning rate {old['learning_rate']:.6g} -> "
            f"{plan.learning_rate:.6g} by lr_scaling={plan.lr_scaling}; the data continues "
            f"from example {position.examples:,}"
        )


def _restart_half_step(
    state: Any,
    position: Position,
    old: dict,
    plan: Any,
    setup: Any,
    echo: Callable[[str], None],
) -> tuple[Any, Position, int]:
    """(state, position, micro-steps redone): a saved half-step this plan cannot continue
    starts again from the step boundary, which is exact since params change only at a
    step's last micro-batch."""
    if not (position.micro and not can_continue_accumulation(old, plan, setup.accumulation)):
        return state, position, 0
    redone = position.micro
    echo(
        f"the checkpoint holds {redone} of {old['grad_accum_steps']} micro-batches "
        f"({old['micro_batch_size']} rows each) of optimizer step {position.step + 1}, "
        f"which this plan ({plan.grad_accum_steps} micro-batch"
        f"{'es' if plan.grad_accum_steps != 1 else ''} of {plan.micro_batch_size} rows"
        + (", fused" if setup.accumulation is Accumulation.FUSED else "")
        + ") cannot continue: that step starts again from its first micro-batch "
        "(exact: params change only at a step's last micro-batch)"
    )
    state = empty_accumulator(state)
    position = dataclasses.replace(position, micro=0)
    # The micro-step counter goes back to the step's start as well.
    counter = jax.device_put(
        jnp.asarray(int(state.micro_step) - redone, jnp.int32),
        setup.state_shardings.micro_step,
    )
    return state.replace(micro_step=counter), position, redone


def empty_accumulator(state: Any) -> Any:
    """The state at the optimizer-step boundary before a mid-step `state`: MultiSteps'
    accumulator emptied; params and inner optimizer state change only at a step's end."""
    ms = state.opt_state
    opt_state = ms._replace(
        mini_step=jnp.zeros_like(ms.mini_step),
        acc_grads=jax.tree.map(jnp.zeros_like, ms.acc_grads),  # None stays None
    )
    return state.replace(opt_state=opt_state)
