"""Which malloc a prefill process runs with on this machine.

A prefill instance allocates activations, KV and parked state of every size its prompts
need. With glibc's allocator its resident memory creeps up under steady mixed load and is
not given back: in a 10-minute soak at 70 % of the stack's goodput on a quiet machine
(docs/stack.md, "Soak") the prefill process went 1.8 → 2.5 GB while nothing was parked
(+74 MB/min), while with jemalloc preloaded it stayed at 1.0 GB (1,041 → 1,034 MB) at the
same attainment, and with glibc's mmap threshold fixed at 128 KiB at ~1.0-1.1 GB too.
Freed large blocks kept on glibc's heap once its dynamic mmap threshold has risen, not
objects the engine keeps: a leak would grow under every allocator.

So ``flowprefill up`` preloads jemalloc into its prefill processes where the library is
installed (Debian: ``libjemalloc2``) and the user has not set ``LD_PRELOAD`` themselves;
``--system-malloc`` keeps glibc's.
"""

from __future__ import annotations

import ctypes.util
from collections.abc import Callable, Mapping

PRELOAD_ENV = "LD_PRELOAD"


def preload_env(
    environ: Mapping[str, str], find: Callable[[str], str | None] = ctypes.util.find_library
) -> dict[str, str]:
    """The environment that preloads jemalloc: ``{LD_PRELOAD: libjemalloc.so.N}`` when the
    dynamic linker can find it (a bare soname is searched like a needed library), nothing
    when it is not installed or ``LD_PRELOAD`` is already set (the user's choice wins)."""
    if environ.get(PRELOAD_ENV):
        return {}
    name = find("jemalloc")
    return {PRELOAD_ENV: name} if name else {}
