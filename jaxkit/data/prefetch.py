"""Loading off the critical path: the next micro-steps' batches are read and placed on the
devices by one background thread while the devices compute the current one.

The data order is a function of the position alone (data.py), so the loop can name the
batches it will ask for next: the rest of this optimizer step's micro-steps, then the next
steps' under the batch schedule as it stands. A guess that turns out wrong (the auto ramp
changed K at a log boundary) costs one load in the step's path, never a wrong batch: every
batch is handed out only against the key and plan it was loaded for.

One thread, not a pool, keeps the loads in order and the host's memory bounded to `depth`
batches. Grain's loaders were not used: they index a record stream with a fixed batch
size per iterator state, while a jaxkit step's rows follow from the examples consumed
under a global batch that may change mid-run, each process taking its mesh-given slice.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any


@dataclasses.dataclass
class _Pending:
    future: concurrent.futures.Future
    plan: Any


class Prefetcher:
    """`get(key, plan)` returns `load(key, plan)`, loaded ahead where `ahead(...)` said.

    `waited_s` sums the time the loop spent blocked on a batch: the input pipeline's cost
    on the critical path (0 when loading keeps ahead of the devices); `first_wait_s` is the
    first batch's, which nothing could load ahead.
    """

    def __init__(self, load: Callable[[Any, Any], Any], depth: int = 2) -> None:
        self.load, self.depth = load, depth
        self.pending: dict[Hashable, _Pending] = {}
        self.pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxkit-prefetch")
            if depth > 0
            else None
        )
        self.waited_s, self.first_wait_s, self.gets, self.misses = 0.0, 0.0, 0, 0

    def get(self, key: Hashable, plan: Any, ahead: Iterable[tuple[Hashable, Any]] = ()) -> Any:
        """The batch for `key` under `plan`; then starts loading the first `depth` of
        `ahead`, the (key, plan) pairs the loop expects to ask for next, in order."""
        start = time.perf_counter()
        found = self.pending.pop(key, None)
        if found is not None and found.plan == plan:
            batch = found.future.result()  # re-raises a load's error here, in the loop
        else:
            self.misses += found is not None
            batch = self.load(key, plan)
        waited = time.perf_counter() - start
        self.waited_s += waited
        self.first_wait_s = waited if self.gets == 0 else self.first_wait_s
        self.gets += 1
        if self.pool is not None:
            wanted = dict(itertools.islice(ahead, self.depth))
            for stale in [k for k, v in self.pending.items() if wanted.get(k) != v.plan]:
                self.pending.pop(stale).future.cancel()
            for k, p in wanted.items():
                if k not in self.pending:
                    self.pending[k] = _Pending(self.pool.submit(self.load, k, p), p)
        return batch

    def close(self) -> None:
        """Drops batches not yet asked for; waits for a load in flight."""
        for pending in self.pending.values():
            pending.future.cancel()
        self.pending.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
