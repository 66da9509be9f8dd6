"""numpy's BLAS on one thread while the engine steps: its idle workers spin on the cores OpenVINO infers on.

OpenBLAS (numpy's wheels) runs a large enough product (a DSpark Markov walk's [N, 32] x [32, V] bias at
c=8, or at c=1 with a 16k-token draft vocabulary) on a thread per core, and its workers then spin,
waiting for the next call, for a while after it returns. OpenVINO's inference threads, started right
after, share those cores with them. On a 2-core Xeon, a c=8 step of the default DSpark pair took 94 ms
(the target's inference 78 ms) with numpy's two threads and 66 ms (53 ms) with one; at c=1 a DSpark
draft with a 16,384-token vocabulary 48.6 ms against 36.9 (docs/benchmarks.md, twenty-third
session). What one thread costs the engine's own numpy work is small against that: the host time of
that c=8 step rose from 5.1 to 5.7 ms (the Markov walk).

`one_blas_thread()` limits every BLAS library numpy (or anything else in the process) loaded, for
the duration of a block, through threadpoolctl, and restores what was set before on the way out:
an application's own numpy work between engine steps keeps its threads (the limit is the process's,
so numpy work in another thread during a step runs on one thread too). About 8 us a step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator


@functools.cache
def _blas_pools():
    """The BLAS thread pools loaded in this process (looked up once: a scan of the loaded libraries, ~5 ms)."""
    import numpy  # noqa: F401  (its BLAS must be loaded to be found)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(user_api="blas")


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run the block with BLAS limited to one thread, then restore the previous limits."""
    with _blas_pools().limit(limits=1):
        yield
