"""--manual-gc: Python's collector off during training, full collections at the chosen iterations and around
evaluations, the collector restored after training; the pause tools/aggregate.py takes restores what it found.
Observed through gc.callbacks, the interpreter's own report of each collection."""

import gc
from types import SimpleNamespace

import pytest

from megatron.training.garbage_collection import ManualGarbageCollection, cycle_collection_paused


@pytest.fixture
def collections():
    """The generation of every collection the interpreter runs while the test does."""
    seen = []

    def record(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    was_enabled = gc.isenabled()
    yield seen
    gc.callbacks.remove(record)
    (gc.enable if was_enabled else gc.disable)()


def _manual(enabled=True, interval=0, around_evaluation=True):
    return ManualGarbageCollection(SimpleNamespace(manual_gc=enabled, manual_gc_interval=interval,
                                                   manual_gc_eval=around_evaluation))


def test_full_collections_only_at_multiples_of_the_interval_and_around_evaluations(collections):
    gc.enable()
    manual = _manual(interval=3)
    manual.start()
    assert not gc.isenabled() and collections == [2]  # what setup left behind
    full_at = []
    for iteration in range(1, 10):
        before = len(collections)
        manual.after_iteration(iteration)
        if collections[before:] == [2]:
            full_at.append(iteration)
    assert full_at == [3, 6, 9] and len(collections) == 4
    with manual.evaluation():
        assert collections[-1] == 2
    assert collections[-2:] == [2, 0]  # the evaluation's young objects after it
    manual.stop()
    assert gc.isenabled()


def test_interval_0_never_collects_between_iterations_and_no_eval_skips_evaluations(collections):
    gc.enable()
    manual = _manual(interval=0, around_evaluation=False)
    manual.start()
    for iteration in range(1, 50):
        manual.after_iteration(iteration)
    with manual.evaluation():
        pass
    assert collections == [2]
    manual.stop()
    assert gc.isenabled()


def test_without_manual_gc_the_collector_is_left_alone(collections):
    gc.disable()  # whatever state the caller chose stays
    manual = _manual(enabled=False, interval=2)
    manual.start()
    manual.after_iteration(2)
    with manual.evaluation():
        pass
    manual.stop()
    assert collections == [] and not gc.isenabled()


def test_stop_restores_a_collector_that_was_off_before(collections):
    gc.disable()
    manual = _manual(interval=1)
    manual.start()
    manual.stop()
    assert not gc.isenabled()


def test_cycle_collection_is_paused_inside_and_its_state_restored_after():
    assert gc.isenabled()
    with cycle_collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with cycle_collection_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()
