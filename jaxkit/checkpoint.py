"""Checkpoints that lose nothing, with orbax-checkpoint.

A checkpoint is keyed by the micro-step count, so a save between optimizer steps (on
SIGTERM) is as valid as one at a boundary. It holds the whole train state (params, the
MultiSteps accumulator and counters, the inner optimizer state) plus a JSON record of the
config, the batch plan and the host-side loop state. The data position is derived from the
step, so no iterator state and no topology is saved; the only randomness is the config's
seed (model init and data order), which the saved config carries.

Saves are asynchronous; orbax writes each into a temporary directory and renames it when
complete, so a crash or `kill -9` at any moment leaves either a whole checkpoint or a
temporary one that is ignored and cleaned up, never loaded.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxkit.config import flatten
from jaxkit.workdir import absolute, missing_gcs_support

# Config keys that may differ between a run and its resumption: where it runs, how the batch
# is split (the global batch is checked on its own), and what is logged or saved.
RESUMABLE_KEYS = (
    "name",
    "mesh.",
    "batch.",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.profile_steps",
    "train.max_nonfinite_in_row",
    "train.accumulation",  # both modes keep MultiSteps' state layout
    "checkpoint.",
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from as asked."""


@dataclasses.dataclass
class Restored:
    micro_step: int  # micro-batches consumed when it was saved
    state: Any  # the TrainState, placed with the target shardings
    meta: dict  # {"config", "plan", "loop"}: as saved


def _names(path: tuple) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def config_conflicts(saved: dict, current: dict) -> list[str]:
    """Lines `key: saved -> current` for every difference that would change the model."""
    old, new = flatten(saved), flatten(current)
    lines = []
    for key in sorted(old.keys() | new.keys()):
        if key.startswith(RESUMABLE_KEYS) or old.get(key) == new.get(key):
            continue
        lines.append(
            f"  {key}: {old.get(key, '<absent>')!r} (saved) -> {new.get(key, '<absent>')!r}"
        )
    return lines


class Checkpointer:
    """Saves and restores train states under WORKDIR/checkpoints/, a local path or a URL.

    On gs://, orbax writes through tensorstore's GCS driver and, since a rename there is a
    copy, marks a whole save with a commit file instead of renaming a temporary directory.
    """

    def __init__(self, directory: str | os.PathLike, keep: int, warn: Callable[[str], None]):
        missing = missing_gcs_support(directory)
        if missing:
            raise CheckpointError(missing)
        # An epath.Path: orbax picks its GCS code paths from a "gs://" prefix, which a
        # pathlib.Path would have turned into a local "gs:/" directory.
        self.directory = absolute(directory)
        self.warn = warn
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                create=True,
                cleanup_tmp_directories=True,  # what a killed save left behind
                enable_async_checkpointing=True,
            ),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )
        self.blocking_s = 0.0  # time the training loop spent inside save()
        self.saves = 0

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, micro_step: int, state: Any, meta: dict, *, wait: bool = False) -> None:
        """Starts an async save of `state` at `micro_step`; `wait` blocks until it is on disk."""
        start = time.perf_counter()
        self.manager.save(
            micro_step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        self.blocking_s += time.perf_counter() - start
        self.saves += 1
        if wait:
            self.manager.wait_until_finished()

    def read_meta(self, micro_step: int) -> dict:
        restored = self.manager.restore(
            micro_step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )
        return dict(restored.meta)

    def restore(self, micro_step: int, abstract_state: Any) -> Any:
        """The state saved at `micro_step`, placed as `abstract_state`'s shardings say."""
        restored = self.manager.restore(
            micro_step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)),
        )
        return restored.state

    def restore_latest(
        self, abstract_state: Any, check: Callable[[int, dict], None]
    ) -> Restored | None:
        """The newest checkpoint that reads back whole, or None when there is none.

        `check(micro_step, meta)` runs before anything is restored and may refuse (raise);
        a checkpoint whose arrays do not fit `abstract_state` is refused too. Only a
        checkpoint that fails to read is set aside (with a warning naming it) for the one
        before it.
        """
        for micro_step in reversed(self.steps()):
            try:
                meta = self.read_meta(micro_step)
            except Exception as err:  # whatever fails to read is unusable
                self._set_aside(micro_step, err)
                continue
            check(micro_step, meta)
            try:
                saved = self.manager.item_metadata(micro_step)["state"]
            except Exception as err:  # unreadable array metadata
                self._set_aside(micro_step, err)
                continue
            self._check_shapes(micro_step, saved, abstract_state)
            try:
                state = self.restore(micro_step, abstract_state)
            except Exception as err:  # a torn or corrupted checkpoint
                self._set_aside(micro_step, err)
                continue
            return Restored(micro_step=micro_step, state=state, meta=meta)
        return None

    def _check_shapes(self, micro_step: int, saved: Any, abstract_state: Any) -> None:
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
            raise CheckpointError(
                f"the checkpoint at micro-step {micro_step} in {self.directory} was written by "
                "a different model:\n" + "\n".join(problems[:10] or ["  (different tree)"])
            )

    def _set_aside(self, micro_step: int, err: Exception) -> None:
        step_dir = self.directory / str(micro_step)
        aside = self.directory / f"{micro_step}.unreadable"
        self.warn(
            f"warning: checkpoint at micro-step {micro_step} is unreadable "
            f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); moved to {aside.name}, "
            "falling back to the one before it"
        )
        if jax.process_index() == 0:
            step_dir.rename(aside)
        self.manager.reload()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def abstract_state(setup: Any) -> Any:
    """Shapes, dtypes and target shardings of a fresh train state, nothing allocated."""
    shapes = jax.eval_shape(setup.init, jax.random.key(0))
    return jax.tree.map(
        lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        shapes,
        setup.state_shardings,
    )


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


def resume(
    checkpointer: Checkpointer,
    setup: Any,
    config: Any,
    plan: Any,
    allow_batch_change: bool,
    echo: Callable[[str], None],
) -> Restored | None:
    """Restores the latest checkpoint onto this run's mesh and plan, or None to start fresh.

    The global batch is what must not change silently: the config's free batch field is
    re-derived for the new mesh, so grad_accum_steps (or per_device_batch_size) absorbs a
    change of device count. A changed global batch is refused unless `allow_batch_change`.
    """
    if not checkpointer.steps():
        return None
    current = config.to_dict()
    new_plan = plan.to_json()

    def check(micro_step: int, meta: dict) -> None:
        conflicts = config_conflicts(meta["config"], current)
        if conflicts:
            raise CheckpointError(
                f"{checkpointer.directory.parent} holds a run with a different config; "
                "resuming would train a different model:\n"
                + "\n".join(conflicts)
                + "\nUse the saved values, or a new --workdir."
            )
        old = meta["plan"]
        if old["global_batch_size"] != plan.global_batch_size and not allow_batch_change:
            raise CheckpointError(
                f"resuming here changes the global batch from {old['global_batch_size']} to "
                f"{plan.global_batch_size}, which trains a different model:\n"
                + plans_side_by_side(old, new_plan)
                + "\nLeave one of batch.per_device_batch_size / batch.grad_accum_steps free "
                "(null) so it is re-derived, or pass --allow-batch-change to accept it (the "
                f"learning rate then follows optimizer.lr_scaling={plan.lr_scaling!r})."
            )
        old_k = old["grad_accum_steps"]
        if micro_step % old_k and config.train.accumulation == "fused":
            raise CheckpointError(
                f"the latest checkpoint was saved in the middle of optimizer step "
                f"{micro_step // old_k} (micro-step {micro_step % old_k} of {old_k}); fused "
                "accumulation starts from whole steps. Resume once with "
                "train.accumulation=multisteps to finish that step."
            )
        if micro_step % old_k and old_k != plan.grad_accum_steps:
            raise CheckpointError(
                f"the latest checkpoint was saved in the middle of optimizer step "
                f"{micro_step // old_k} (micro-step {micro_step % old_k} of {old_k}), and this "
                f"plan accumulates {plan.grad_accum_steps} micro-steps: a half-filled "
                "accumulator cannot be re-split. Resume once on the saved topology "
                f"(grad_accum_steps={old_k}) to finish that step, then move."
            )

    restored = checkpointer.restore_latest(abstract_state(setup), check)
    if restored is None:
        echo("warning: no readable checkpoint left; starting from scratch")
        return None
    old = restored.meta["plan"]
    step, micro = divmod(restored.micro_step, old["grad_accum_steps"])
    echo(
        f"resuming from {checkpointer.directory} at optimizer step {step}"
        + (f", micro-step {micro} of {old['grad_accum_steps']}" if micro else "")
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
            f"{plan.learning_rate:.6g} by lr_scaling={plan.lr_scaling}"
        )
    micro_step = step * plan.grad_accum_steps + micro  # re-based when K changed at a boundary
    state = restored.state
    if micro_step != restored.micro_step:
        counter = jax.device_put(
            jax.numpy.asarray(micro_step, jax.numpy.int32), setup.state_shardings.micro_step
        )
        state = state.replace(micro_step=counter)
    return Restored(micro_step=micro_step, state=state, meta=restored.meta)
