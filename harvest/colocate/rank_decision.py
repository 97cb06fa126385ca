"""Who decides for this rank: the rank alone, or rank 0 for every tensor-parallel rank.

:class:`~harvest.colocate.colocation.Colocation` asks one of these, the same way on every
rank, for each step's plan, the step's feedback and lending, the idle tick's decision,
and to carry trainer faults, operator commands and lending requests to where they are
handled: :class:`Alone` at this rank's next step or idle tick, :class:`WithRanks` at the
ranks' next exchange (harvest.colocate.rank_sync), where every rank applies them at once.
Lending's state changes through the :class:`~harvest.colocate.lending_state.LendingSwitch`.
"""

from __future__ import annotations

from typing import Callable

from harvest.colocate.rank_sync import Field, LendingRequest, OperatorCode, SlowestRank, new_row
from harvest.logs import get_logger

logger = get_logger(__name__)

_OPERATOR_CODES = {"pause": OperatorCode.PAUSE, "resume": OperatorCode.RESUME, "stop": OperatorCode.STOP}


def rank_decision(ranks, *, step_controller, timer, lending, switch, trainer_host, metrics, trainer_tp,
                  request_attention: Callable[[], None]):
    """:class:`Alone` without tensor parallelism (``ranks`` None), else :class:`WithRanks`."""
    if ranks is None:
        return Alone(step_controller=step_controller, timer=timer, lending=lending, switch=switch, trainer_host=trainer_host,
                     metrics=metrics, request_attention=request_attention)
    return WithRanks(ranks, step_controller=step_controller, timer=timer, lending=lending, switch=switch, trainer_host=trainer_host,
                     metrics=metrics, trainer_tp=trainer_tp)


class Alone:
    """This rank decides for itself; faults and lending requests wait for its next step or
    idle tick (``attend``)."""

    last_agreement = None
    every_ranks_trainer_ended = False

    def __init__(self, *, step_controller, timer, lending, switch, trainer_host, metrics, request_attention):
        self.step_controller = step_controller
        self.timer = timer
        self.lending = lending
        self.switch = switch
        self.trainer_host = trainer_host
        self.metrics = metrics
        self._request_attention = request_attention
        self._fault_pending = False
        self._lending_request: str | None = None  # an operator's "return" or "resume", for the engine thread

    # -- the step and the idle tick (engine thread) ------------------------------------------
    def step(self, load):
        return self.step_controller.before_step(load)

    def feed_back(self) -> None:
        for tag, measured_s in self.timer.completed():
            self.step_controller.after_step(tag, measured_s)

    def lend(self) -> None:
        self.lending.maybe_lend()  # at most every lend interval: a busy server lends too

    def idle(self) -> None:
        self.step_controller.on_idle()
        self.lending.maybe_lend()

    def attend(self) -> None:
        request, self._lending_request = self._lending_request, None
        if request == "return":
            self.lending.return_all()
        elif request == "resume":
            self.switch.resume()
        if self._fault_pending:
            self._fault_pending = False
            if self.metrics is not None:
                self.metrics.trainer_fault()
            self.switch.take_all_back()
            logger.info("trainer fault handled: %d KV chunks lent now, decode has every SM", self.lending.num_lent)
            self.lend_again()

    def integrity_failed(self, message: str) -> None:
        self.switch.integrity_failed(message)
        self.switch.broken()

    def lend_again(self) -> None:
        host = self.trainer_host
        if host is not None and host.live:
            self.switch.lend_again()

    # -- from other threads --------------------------------------------------------------------
    def trainer_faulted(self) -> None:
        """Trainer thread: handled on the engine thread (``attend``)."""
        self._fault_pending = True
        self._request_attention()

    def operator_action(self, action: str) -> None:
        pass  # applied here by Colocation.operator

    def request_lending(self, request: str) -> None:
        self._lending_request = request
        self._request_attention()


class WithRanks:
    """Tensor-parallel: rank 0 decides (the step's level and gate, the idle tick's, the
    lend clock, the operator's commands) and every rank applies that decision and what
    else the exchange says, at the same point of the scheduler loop."""

    def __init__(self, ranks, *, step_controller, timer, lending, switch, trainer_host, metrics, trainer_tp):
        self.ranks = ranks
        self.step_controller = step_controller
        self.timer = timer
        self.lending = lending
        self.switch = switch
        self.trainer_host = trainer_host
        self.metrics = metrics
        # The trainer's TensorParallel, whose waits are given up when another rank's trainer faults.
        self.trainer_tp = trainer_tp
        self._slowest = SlowestRank(ranks.size)
        self._measured: list[tuple[int, float]] = []  # this rank's measurements, for the next exchange
        self._operator_out = OperatorCode.NONE  # rank 0: for every rank, with the next exchange
        self._lending_out = LendingRequest.NONE
        self._local_fault = False  # this rank's trainer faulted: told at the next exchange
        self._fault_handled = False
        self._lend_tick = False  # rank 0's lend clock, as the last exchange said
        self.last_agreement = None
        lending.ranks = ranks  # the mechanism moves chunks only when every rank can

    @property
    def every_ranks_trainer_ended(self) -> bool:
        """At the last exchange, no rank's trainer job was running (so no rank needs a peer
        for its trainer any more: the collective checkpoint is written)."""
        agreed = self.last_agreement
        return agreed is not None and agreed.trainers_ended

    # -- the step and the idle tick (engine thread) ------------------------------------------
    def step(self, load):
        return self._agree(load)

    def feed_back(self) -> None:
        self._measured.extend(self.timer.completed())  # rank 0 takes the slowest rank's, after the exchange

    def lend(self) -> None:
        self.lending.maybe_lend(tick=self._lend_tick)  # when rank 0's clock says, on every rank

    def idle(self) -> None:
        self._agree(None)
        self.lending.maybe_lend(tick=self._lend_tick)

    def attend(self) -> None:
        pass  # faults and lending requests travel with the next exchange

    def integrity_failed(self, message: str) -> None:
        # Told at the next exchange (LENDING_OK), where every rank's lending turns BROKEN at once.
        self.switch.integrity_failed(message)

    def lend_again(self) -> None:
        pass  # after a fault every rank stays off: the ranks would have to agree to lend again

    # -- from other threads --------------------------------------------------------------------
    def trainer_faulted(self) -> None:
        """Trainer thread: told at the next exchange, where every rank handles it."""
        self._local_fault = True

    def operator_action(self, action: str) -> None:
        """Rank 0's endpoint: every other rank applies it at the next exchange."""
        self._operator_out = _OPERATOR_CODES.get(action, OperatorCode.NONE)

    def request_lending(self, request: str) -> None:
        """Rank 0's endpoint: every rank moves memory at the next exchange."""
        self._lending_out = LendingRequest.RETURN if request == "return" else LendingRequest.RESUME

    # -- the exchange ----------------------------------------------------------------------------
    def _agree(self, load):
        """One exchange: rank 0's decision (a step's plan when ``load`` is given, else the
        idle tick's), applied here with what else the ranks agreed. Returns the step's plan
        (None on an idle tick)."""
        ranks, step_controller, lending = self.ranks, self.step_controller, self.lending
        row = new_row()
        plan = None
        if ranks.leader:
            if load is not None:
                plan = step_controller.before_step(load)
                row[Field.TAG] = plan.step
            else:
                step_controller.on_idle()
            row[Field.LEVEL], row[Field.RUN] = step_controller.applied
            row[Field.OPERATOR], self._operator_out = self._operator_out, OperatorCode.NONE
            row[Field.LENDING_REQUEST], self._lending_out = self._lending_out, LendingRequest.NONE
            row[Field.LEND_TICK] = lending.lend_due()
        for index, (tag, seconds) in enumerate(self._measured[-2:]):
            row[Field.MEASURED_TAG_1 + 2 * index], row[Field.MEASURED_S_1 + 2 * index] = tag, seconds
        self._measured.clear()
        row[Field.FAULT] = self._local_fault
        row[Field.NUM_TAKEN] = lending.num_taken
        row[Field.MOVES_DIGEST] = lending.moves_digest
        row[Field.LENDING_OK] = self.switch.integrity_error is None
        row[Field.TRAINER_ENDED] = self.trainer_host is None or self.trainer_host.join(0)
        agreed = ranks.exchange(row)
        self.last_agreement = agreed
        if ranks.leader:
            for tag, seconds in self._slowest.add(agreed.measurements):
                step_controller.after_step(tag, seconds)
        elif load is not None:
            plan = step_controller.follow(agreed.tag, agreed.level, agreed.run)
        elif agreed.level >= 0:
            step_controller.apply_decision(agreed.level, agreed.run)
        self._apply(agreed)
        self._lend_tick = agreed.lend_tick
        return plan

    def _apply(self, agreed) -> None:
        host, switch = self.trainer_host, self.switch
        if agreed.operator is not OperatorCode.NONE and not self.ranks.leader and host is not None:
            if agreed.operator is OperatorCode.PAUSE:
                host.operator_pause()
            elif agreed.operator is OperatorCode.RESUME:
                host.operator_resume()
            elif agreed.operator is OperatorCode.STOP:
                switch.stop()
                host.operator_stop()
        if agreed.lending_request is LendingRequest.RETURN:
            self.lending.return_all()
        elif agreed.lending_request is LendingRequest.RESUME:
            switch.resume()
        if agreed.faulted_ranks and not self._fault_handled:
            self._fault_handled = True
            ranks = ", ".join(map(str, agreed.faulted_ranks))
            if self.trainer_tp is not None:
                self.trainer_tp.abort(f"the trainer of rank {ranks} faulted")
            if self.metrics is not None and self.ranks.leader:
                self.metrics.trainer_fault()
            switch.take_all_back()  # every rank here, at once: the same chunks come back everywhere
            logger.info("trainer fault on rank %s handled: %d KV chunks lent now, decode has every SM", ranks,
                        self.lending.num_lent)
        broken = agreed.lending_broken_ranks
        if (broken or agreed.diverged) and switch.ranks_stopped_why is None:
            # Nothing is reclaimed: with a rank's bookkeeping in doubt, putting slots back
            # could hand SGLang a slot twice (as on one rank: LendingSwitch.integrity_failed).
            switch.broken(f"the KV integrity check failed on rank {', '.join(map(str, broken))}" if broken
                          else f"the ranks' lent chunks differ (counts {agreed.taken_by_rank}, "
                               f"digests {agreed.digests_by_rank})")
            if host is not None:
                host.operator_stop()  # on every rank: the trainers vote stop together and checkpoint
            logger.error("lending and the trainer are stopped on every rank, serving goes on: %s",
                         switch.ranks_stopped_why)
