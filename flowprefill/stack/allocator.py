"""Which malloc a prefill process runs with on this machine.

A prefill instance allocates activations, KV and parked state of every size its prompts
need. Under glibc's malloc its resident memory grows under steady mixed load and is not
given back (freed large blocks stay on glibc's heap once its dynamic mmap threshold has
risen); under jemalloc it stays flat. docs/stack.md ("Soak") has the measurements and the
commands that produced them.

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
