"""LendingSwitch (harvest.colocate.lending_state): one state where the step loop kept
flags. A fault takes every chunk back and a live job lends again; an operator's stop and
a broken bookkeeping end lending for good, the stop outranking the break either way."""

from __future__ import annotations

import pytest

from harvest.colocate.lending_state import LendingState, LendingSwitch, NoKvLending


class Mechanism:
    def __init__(self):
        self.calls, self.enabled = [], True

    def reclaim_all(self):
        self.calls.append("reclaim_all")
        self.enabled = False

    def resume_lending(self):
        self.calls.append("resume")


def test_a_fault_takes_every_chunk_back_and_a_live_job_lends_again():
    switch = LendingSwitch(Mechanism())
    switch.take_all_back()
    assert switch.state is LendingState.FAULTED and switch.lending.enabled is False and switch.may_lend
    switch.lend_again()
    assert switch.state is LendingState.LENDING and switch.lending.enabled is True
    assert switch.lending.calls == ["reclaim_all", "resume"]


@pytest.mark.parametrize("end", ["stop", "integrity", "ranks"])
def test_stopped_or_broken_lending_never_resumes(end):
    switch = LendingSwitch(Mechanism())
    if end == "stop":
        switch.stop()
    elif end == "integrity":
        switch.integrity_failed("KvIntegrityError: chunk 3")
        switch.broken()
    else:
        switch.broken("the ranks' lent chunks differ")
    switch.resume()
    switch.take_all_back()
    switch.lend_again()
    assert switch.lending.calls == ["reclaim_all"] and not switch.may_lend
    assert switch.state is (LendingState.STOPPED if end == "stop" else LendingState.BROKEN)
    assert switch.operator_stopped is (end == "stop")


def test_the_operators_stop_outranks_a_break_either_way_and_the_messages_stay():
    switch = LendingSwitch(Mechanism())
    switch.integrity_failed("KvIntegrityError: chunk 3")
    switch.broken()
    switch.stop()
    assert switch.state is LendingState.STOPPED and switch.integrity_error == "KvIntegrityError: chunk 3"
    switch = LendingSwitch(Mechanism())
    switch.stop()
    switch.broken("the KV integrity check failed on rank 1")
    assert switch.state is LendingState.STOPPED and switch.lending.enabled is False
    assert switch.ranks_stopped_why == "the KV integrity check failed on rank 1"


def test_a_rank_whose_own_check_failed_waits_for_the_ranks_agreement():
    switch = LendingSwitch(Mechanism())
    switch.integrity_failed("VmmIntegrityError: page 7")
    assert switch.state is LendingState.LENDING and switch.lending.enabled is False  # nothing moves here already


def test_an_engine_without_managed_kv_is_never_lent_again():
    switch = LendingSwitch(NoKvLending())
    switch.take_all_back()
    switch.lend_again()
    assert switch.lending.enabled is False
