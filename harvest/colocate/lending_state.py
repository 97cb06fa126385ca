"""Whether KV lending runs on this rank, and why not: one state where the step loop kept
flags that had to agree.

The lending mechanism (harvest.sglang.kv_lending.KvLendingController, or
:class:`NoKvLending`) moves the chunks; :class:`LendingSwitch` holds its
:class:`LendingState` and is the one place that turns it off or on again. Invariants: an
operator's pause is not a state here (the mechanism returns and re-lends the memory while
the state stays LENDING); STOPPED outranks BROKEN; on a tensor-parallel instance the state
changes only with the ranks' agreement, so every rank turns BROKEN at the same exchange
(harvest.colocate.rank_decision).
"""

from __future__ import annotations

import enum


class LendingState(enum.Enum):
    LENDING = "lending"  # chunks lent and reclaimed as the policy says
    FAULTED = "faulted"  # a trainer fault took every chunk back; a live job gets lent memory again
    STOPPED = "stopped"  # the operator stopped the trainer: every chunk comes back, none is lent until a restart
    # The KV bookkeeping is in doubt (an integrity check failed; tensor-parallel: on some
    # rank, or the ranks' lent chunks differ): nothing more is lent, the trainer stops,
    # serving goes on with the memory decode has.
    BROKEN = "broken"


class NoKvLending:
    """An engine whose KV cache harvest does not manage: nothing is lent."""

    num_lent = 0
    num_taken = 0
    enabled = False
    moves_digest = 0

    def lend_due(self) -> bool:
        return False

    def after_step(self) -> None:
        pass

    def maybe_lend(self, force: bool = False, tick: bool | None = None) -> None:
        pass

    def reclaim_all(self) -> None:
        pass

    def return_all(self) -> None:
        pass

    def resume_lending(self) -> None:
        pass

    def maybe_check_integrity(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {}


class LendingSwitch:
    """The lending mechanism's state on this rank and its transitions (engine thread,
    except :attr:`operator_stopped`, read by the control endpoint's thread too)."""

    def __init__(self, lending):
        self.lending = lending
        self.state = LendingState.LENDING
        self.integrity_error: str | None = None  # this rank's first failed integrity check
        self.ranks_stopped_why: str | None = None  # tensor-parallel: why lending stopped on every rank

    @property
    def operator_stopped(self) -> bool:
        return self.state is LendingState.STOPPED

    @property
    def may_lend(self) -> bool:
        """Neither stopped nor broken: an operator's resume, or a live job, lends again."""
        return self.state is LendingState.LENDING or self.state is LendingState.FAULTED

    def resume(self) -> None:
        """An operator's resume: lend again, unless lending stopped for good."""
        if self.may_lend:
            self.lending.resume_lending()

    def take_all_back(self) -> None:
        """A trainer fault: every lent chunk back, nothing lent until :meth:`lend_again`."""
        self.lending.reclaim_all()
        if self.state is LendingState.LENDING:
            self.state = LendingState.FAULTED

    def lend_again(self) -> None:
        """A job is live after a fault took every chunk back (or was submitted): lend again,
        unless lending stopped for a reason that concerns every job."""
        if isinstance(self.lending, NoKvLending) or not self.may_lend:
            return
        self.lending.enabled = True
        self.lending.resume_lending()
        self.state = LendingState.LENDING

    def stop(self) -> None:
        """The operator's stop (the memory comes back through the mechanism's return_all)."""
        self.state = LendingState.STOPPED

    def integrity_failed(self, message: str) -> None:
        """This rank's integrity check failed: nothing more moves here. Nothing is
        reclaimed: with the bookkeeping wrong, putting slots back could hand the engine a
        slot twice. (The state turns BROKEN through :meth:`broken`: at once on one rank,
        at the next exchange on every tensor-parallel rank.)"""
        self.integrity_error = message
        self.lending.enabled = False

    def broken(self, ranks_why: str | None = None) -> None:
        """Lending stops for good (``ranks_why``: why, on every tensor-parallel rank)."""
        if ranks_why is not None:
            self.ranks_stopped_why = ranks_why
        self.lending.enabled = False
        if self.state is not LendingState.STOPPED:
            self.state = LendingState.BROKEN
