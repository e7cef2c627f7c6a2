"""flowprefill.web.gc_tuning: what startup built leaves the collector's scans; what is
made later is still collected."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from flowprefill.web.gc_tuning import GATEWAY_YOUNG_THRESHOLD, freeze_startup


@pytest.fixture
def restore_gc() -> Iterator[tuple[int, int, int]]:
    before = gc.get_threshold()
    try:
        yield before
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


class Node:
    def __init__(self) -> None:
        self.me = self


def test_startup_is_frozen_and_later_cycles_are_still_collected(
    restore_gc: tuple[int, int, int],
) -> None:
    kept = Node()  # built "at startup"
    freeze_startup()
    assert gc.get_threshold() == restore_gc  # Python's thresholds unless asked
    assert gc.get_freeze_count() > 1000  # the modules imported so far, at least
    assert not any(o is kept for o in gc.get_objects())  # no longer scanned
    Node()  # a cycle made after the freeze
    assert gc.collect() >= 1


def test_the_gateway_collects_the_young_generation_less_often(
    restore_gc: tuple[int, int, int],
) -> None:
    freeze_startup(GATEWAY_YOUNG_THRESHOLD)
    assert gc.get_threshold() == (GATEWAY_YOUNG_THRESHOLD, restore_gc[1], restore_gc[2])


def test_the_servers_freeze_once_startup_is_done() -> None:
    """Both command lines call it (their startup is too heavy to run here)."""
    import inspect

    from flowprefill.gateway import cli as gateway_cli
    from flowprefill.prefill.server import cli as prefill_cli

    assert "freeze_startup(GATEWAY_YOUNG_THRESHOLD)" in inspect.getsource(gateway_cli.run)
    source = inspect.getsource(prefill_cli.run)
    assert source.index("freeze_startup()") < source.index("serve(server, kv_server)")
