"""featbake.gcpause: the collector is off inside ``gc_paused``, restored after."""

from __future__ import annotations

import gc

import pytest

from featbake.gcpause import gc_paused

# ``gc_paused``: the collector is off inside, restored after (also after an error, and nested).


def test_the_collector_is_paused_inside_and_restored_after_an_error() -> None:
    assert gc.isenabled()
    with pytest.raises(KeyError), gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves the outer one's pause alone
        raise KeyError("boom")
    assert gc.isenabled()


def test_a_caller_that_turned_the_collector_off_keeps_it_off() -> None:
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
