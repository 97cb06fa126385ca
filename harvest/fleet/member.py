"""A fleet member: this process's part in one job trained by many servers.

:class:`FleetMember` claims global steps for the trainer, keeps its heartbeat, and (in
``periodic`` mode) takes part in the rounds that average the members' LoRA weights on a
sync thread of its own; no decode thread ever waits for it. Invariants: every round holds
every live member, so after it all of them start from the same weights; what a trainer
trains during a collective is kept (``result + (now − snapshot)``); a failed collective
changes nothing; after the job is finished no round runs, and no member is done before
the final adapter is written.

Rules: docs/fleet.md, 'The synchronisation rules' and 'A member's threads and store keys'.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import socket
import threading
import time
from typing import Any, Protocol

from harvest.fleet import averaging
from harvest.fleet.options import FleetOptions
from harvest.fleet.store import FleetError, job_store, open_store
from harvest.fleet.work import (CHECKPOINTED, FINAL_HOLDERS, FINAL_WRITER, FINAL_WRITTEN, ROUND, StepQueue,
                                as_ranges)

logger = logging.getLogger(__name__)
POLL_S = 0.02


class FleetTrainer(Protocol):
    """What a member needs of its trainer (harvest.train.fleet_link.FleetLink)."""

    def fleet_snapshot(self) -> tuple[Any, int, list[int]]: ...  # (flat weights, tokens, steps) since the last round

    def fleet_apply(self, result, snapshot) -> None: ...

    def fleet_checkpoint(self, fleet_state: dict, final: bool) -> None: ...


class FleetMember:
    def __init__(self, options: FleetOptions, *, job_id: str, total_steps: int, fingerprint: dict,
                 save_steps: int | None = None):
        self.options = options
        self.save_steps = save_steps  # a fleet checkpoint each time the committed steps pass a multiple
        self.job_id = job_id
        self.total_steps = total_steps
        self.fingerprint = fingerprint
        self.member_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.store = None  # the job's PrefixStore (this thread's connection)
        self._root_store = None  # keeps a hosted store alive as long as the member
        self._member_index: int | None = None
        self.hosted = False
        self.queue: StepQueue | None = None
        self.trainer: FleetTrainer | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.joined = threading.Event()  # periodic: this member has the fleet's weights
        self.done = False  # periodic: the final adapter is written (read by the decode thread)
        self._error: FleetError | None = None  # periodic: the job cannot finish; the trainer's next claim raises it
        self._final_state: dict | None = None  # periodic: this member holds the finished weights (their checkpoint state)
        self._final_checked_at = -math.inf
        self._orphaned_since: float | None = None  # no live member holds the finished weights since then
        self.outer = (averaging.OuterNesterov(options.outer_lr, options.outer_momentum)
                      if options.outer_optimizer == "nesterov" else None)
        self._liveness: dict[str, tuple[int, float]] = {}  # member -> (beat seen, when it last changed)
        self._stats = dict(rounds=0, rounds_failed=0, rounds_missed=0, round=0, members=0, tokens_contributed=0,
                           last_round_at=None, last_round_tokens=0, steps_requeued=0, hosted_store=False)
        self._last_round_mono: float | None = None
        self.group = None  # every_step: the fixed group
        self.rank = 0
        self.size = 1
        self._committed_seen = 0  # the fleet's committed steps at this member's last look
        self._joined_pace: tuple[float, int] | None = None  # (when, committed) at its first round: the ETA's origin

    # -- life -----------------------------------------------------------------------------
    @property
    def every_step(self) -> bool:
        return self.options.sync == "every_step"

    def start(self, trainer: FleetTrainer, resumed: dict | None) -> None:
        """Connect, register, set up or check the job's queue, start the heartbeat (and,
        periodic, the sync thread). every_step: also form the group (waits for every member)."""
        host, port = self.options.host_port
        store, self.hosted = open_store(host, port, may_host=self.options.host_store == "auto",
                                        timeout_s=self.options.collective_timeout_s)
        self._root_store = store
        self._stats["hosted_store"] = self.hosted
        self.store = job_store(store, self.job_id)
        self.trainer = trainer
        live = self.live_members()
        if len(live) >= self.options.max_members:
            raise FleetError(f"harvest.fleet.max_members: the fleet job {self.job_id!r} already has {len(live)} live "
                             f"member(s); this one is refused")
        self.queue = StepQueue(self.store, self.member_id, self.total_steps)
        self.queue.initialize(self.fingerprint, resumed, self.options.collective_timeout_s)
        self._committed_seen = self.queue.committed
        index = self.store.add("members/count", 1) - 1
        self.store.set(f"members/{index}", self.member_id)
        self._member_index = index
        self.store.add(f"beat/{self.member_id}", 1)
        logger.info("fleet job %s: member %s joined (%s store at %s)", self.job_id, self.member_id,
                    "hosting the" if self.hosted else "the", self.options.rendezvous)
        self._spawn("harvest-fleet-heartbeat", self._heartbeat_loop, store)
        if self.every_step:
            self._form_group()
            self.joined.set()
        else:
            self._spawn("harvest-fleet-sync", self._sync_loop, store)

    def _spawn(self, name: str, target, store) -> None:
        thread = threading.Thread(target=target, args=(job_store(store.clone(), self.job_id),), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def leave(self) -> None:
        """Stop taking part: unsynced steps back to the queue (the others train them), the
        threads end, the membership is withdrawn."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.options.collective_timeout_s)
        if self._member_index is None:
            return  # it never registered
        with contextlib.suppress(Exception):  # the store may be gone with its host
            returned = self.queue.give_back() if not self.every_step else []
            if returned:
                logger.info("fleet job %s: %d unsynced step(s) given back to the fleet", self.job_id, len(returned))
            self.store.set(f"members/{self._member_index}", "")

    @property
    def finished(self) -> bool:
        return self.queue is not None and self.queue.finished

    # -- periodic: the trainer's side -----------------------------------------------------
    def claim(self) -> int | None:
        """The next global step to train, or None (not joined yet, or nothing left to claim)."""
        if self._error is not None:
            raise self._error
        if not self.joined.is_set():
            return None
        with self._lock:
            try:
                return self.queue.claim()
            except FleetError:
                raise
            except Exception as error:  # noqa: BLE001 - the store's connection: say which and why
                raise FleetError(f"fleet job {self.job_id!r}: lost the fleet's store at {self.options.rendezvous} "
                                 f"({error}); this member's unsynced steps are lost with it, the fleet's last "
                                 "checkpoint holds what was synced. Restart the member once the store is back "
                                 "(a `harvest fleet-store` outlives the members)") from None

    @property
    def progress_steps(self) -> int:
        """The fleet's committed steps plus this member's unsynced ones (for progress)."""
        return self.queue.committed + len(self.queue.unsynced) if self.queue is not None else 0

    # -- membership -----------------------------------------------------------------------
    def live_members(self, store=None) -> list[str]:
        """Registered members whose heartbeat moved within ``dead_after_s`` (as this member
        has watched it; a member first seen now counts as live)."""
        store = store or self.store
        count = store.add("members/count", 0)
        now = time.monotonic()
        live = []
        for index in range(count):
            member = store.get(f"members/{index}").decode()
            if not member:
                continue
            beat = store.add(f"beat/{member}", 0)
            seen, since = self._liveness.get(member, (None, now))
            if beat != seen:
                self._liveness[member] = (beat, now)
                since = now
            if now - since < self.options.dead_after_s:
                live.append(member)
        return live

    def _registered(self, store) -> list[str]:
        """Every registered member's id ("" where one left or was dropped)."""
        return [store.get(f"members/{index}").decode() for index in range(store.add("members/count", 0))]

    def _drop_dead(self, store, live: list[str]) -> None:
        count = store.add("members/count", 0)
        for index in range(count):
            member = store.get(f"members/{index}").decode()
            if member and member not in live and member != self.member_id:
                store.set(f"members/{index}", "")
                steps = StepQueue(store, self.member_id, self.total_steps).requeue_member(member)
                self._stats["steps_requeued"] += len(steps)
                logger.warning("fleet job %s: member %s silent for %.0f s, dropped; %d unsynced step(s) re-queued",
                               self.job_id, member, self.options.dead_after_s, len(steps))

    def _heartbeat_loop(self, store) -> None:
        failing = False
        while not self._stop.wait(self.options.heartbeat_s):
            try:
                store.add(f"beat/{self.member_id}", 1)
                failing = False
            except Exception as error:  # noqa: BLE001 - the store's host is gone: said once, not every beat
                if not failing:
                    logger.warning("fleet job %s: heartbeat failed: %s", self.job_id, error)
                failing = True

    # -- periodic: rounds -----------------------------------------------------------------
    def _sync_loop(self, store) -> None:
        next_round = time.monotonic()  # the first round at once: it brings the fleet's weights
        while not self._stop.is_set():
            try:
                if self.queue.finished and (self.joined.is_set() or store.check([FINAL_WRITTEN])):
                    if self._await_final_adapter(store):
                        return
                elif time.monotonic() >= next_round or (self.joined.is_set() and self.queue.all_claimed):
                    self._round(store)
                    next_round = time.monotonic() + self.options.sync_interval_s
            except Exception as error:  # noqa: BLE001 - a round's failure must not end the member
                self._stats["rounds_failed"] += 1
                logger.warning("fleet job %s: round failed: %s", self.job_id, error)
                next_round = time.monotonic() + self.options.sync_interval_s
            self._stop.wait(POLL_S * 5)

    def _round(self, store) -> None:
        options = self.options
        number = int(store.get(ROUND))
        rank = store.add(f"r{number}/arrived", 1) - 1
        fresh = not self.joined.is_set()
        size = None
        live, live_read_at = 0, -math.inf
        while size is None:
            if self._stop.is_set():
                return
            if store.check([f"r{number}/size"]):
                size = int(store.get(f"r{number}/size"))
                break
            if int(store.get(ROUND)) != number or self.queue.finished:
                self._stats["rounds_missed"] += 1
                return  # it ended without this member (closed before it arrived, or failed)
            arrived = store.add(f"r{number}/arrived", 0)
            if time.monotonic() - live_read_at >= options.heartbeat_s:
                # A store read per member: at most once a heartbeat (liveness changes no
                # faster), not every poll of every waiting member.
                live, live_read_at = len(self.live_members(store)), time.monotonic()
            if arrived >= max(options.min_members, live):
                size = int(store.compare_set(f"r{number}/size", "", str(arrived)))
                registered = sum(1 for member in self._registered(store) if member)
                if size == arrived and size < registered:  # this member closed it, without some registered
                    logger.info("fleet job %s: round %d closes with %d of %d registered member(s): the others' "
                                "heartbeats stopped for %.0f s or more", self.job_id, number, size, registered,
                                options.dead_after_s)
            else:
                time.sleep(POLL_S)
        if rank >= size:
            self._stats["rounds_missed"] += 1
            self._wait_round_moves_on(store, number)
            return
        self._run_round(store, number, rank, size, fresh)

    def _wait_round_moves_on(self, store, number: int) -> None:
        deadline = time.monotonic() + self.options.collective_timeout_s
        while int(store.get(ROUND)) == number and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(POLL_S)

    def _run_round(self, store, number: int, rank: int, size: int, fresh: bool) -> None:
        import datetime

        import torch.distributed as dist

        timeout_s = self.options.collective_timeout_s
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"r{number}/pg/", store), rank, size,
                                          datetime.timedelta(seconds=timeout_s))
            snapshot, tokens, steps = self.trainer.fleet_snapshot()
            if fresh:
                tokens = 0  # it trained nothing before joining; its weights are not the fleet's
            mean, total = averaging.weighted_average(group, size, snapshot, tokens, timeout_s, fresh=fresh)
            result = self.outer.step(group, size, mean, snapshot, fresh, timeout_s) if self.outer is not None else mean
        except Exception:
            store.compare_set(ROUND, str(number), str(number + 1))  # every member of it sees the failure
            raise
        self.trainer.fleet_apply(result, snapshot)
        with self._lock:
            self.queue.synced(steps)
        store.add(f"r{number}/synced", 1)
        store.compare_set(ROUND, str(number), str(number + 1))
        if not self.joined.is_set():
            self._joined_pace = (time.monotonic(), self.queue.committed)
        self.joined.set()
        live = self.live_members(store)
        if rank == 0:
            self._drop_dead(store, live)
        now = time.time()
        self._stats.update(rounds=self._stats["rounds"] + 1, round=number + 1, members=size, last_round_at=now,
                           last_round_tokens=total, tokens_contributed=self._stats["tokens_contributed"] + tokens)
        self._last_round_mono = time.monotonic()
        committed = self._committed_seen = self._committed_once_synced(store, number, size)
        logger.info("fleet job %s: round %d: %d member(s), %d token(s) (%d of them this member's), %d/%d step(s) "
                    "committed", self.job_id, number, size, total, tokens, committed, self.total_steps)
        if committed >= self.total_steps:
            self._final_state = self._checkpoint_state(number, size)
            store.append(FINAL_HOLDERS, f"{self.member_id},")
            self._write_final_if_elected(store, expected_writer="")
        elif rank == 0 and self._checkpoint_due(store, committed):
            self.trainer.fleet_checkpoint(self._checkpoint_state(number, size), False)
            store.set(CHECKPOINTED, str(committed))

    def _committed_once_synced(self, store, number: int, size: int) -> int:
        """The fleet's committed steps after every member of round ``number`` synced its
        steps, so its members all decide alike whether the round finished the job. Waits at
        most ``collective_timeout_s``: a member that died since the collective never syncs
        (its steps are re-queued when it is dropped, and a later round finishes the job)."""
        deadline = time.monotonic() + self.options.collective_timeout_s
        while store.add(f"r{number}/synced", 0) < size and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(POLL_S)
        return self.queue.committed

    def _checkpoint_state(self, number: int, size: int) -> dict:
        return dict(round=number + 1, committed_steps=as_ranges(self.queue.committed_steps()), members=size,
                    job_id=self.job_id)

    def _checkpoint_due(self, store, committed: int) -> bool:
        """The committed steps passed a multiple of save_steps since the fleet's last
        checkpoint (whichever member wrote it)."""
        last = int(store.get(CHECKPOINTED)) if store.check([CHECKPOINTED]) else 0
        return bool(self.save_steps) and committed // self.save_steps > last // self.save_steps

    # -- periodic: the end ----------------------------------------------------------------
    def _write_final_if_elected(self, store, expected_writer: str) -> bool:
        """Write the final adapter if this member wins ``final/writer`` (it held
        ``expected_writer``); True once written. A failed write gives the election back,
        so another holder can write, and fails this member's job."""
        if store.compare_set(FINAL_WRITER, expected_writer, self.member_id).decode() != self.member_id:
            return False
        try:
            self.trainer.fleet_checkpoint(self._final_state, True)
        except Exception as error:
            store.compare_set(FINAL_WRITER, self.member_id, "")
            self._error = FleetError(f"fleet job {self.job_id!r}: writing the final adapter failed: {error}")
            raise
        committed = sum(last - first + 1 for first, last in self._final_state["committed_steps"])
        store.set(CHECKPOINTED, str(committed))
        store.set(FINAL_WRITTEN, self.member_id)
        self.done = True
        return True

    def _await_final_adapter(self, store) -> bool:
        """Every step is committed: wait until the final adapter is written (True), writing
        it if this member holds the finished weights and the elected writer is gone. True
        also when nobody left can write it (the job fails with an error saying so)."""
        if self._error is not None:
            return True  # this member's job has failed (its trainer raises it)
        if store.check([FINAL_WRITTEN]):
            self.done = True
            return True
        now = time.monotonic()
        if now - self._final_checked_at < self.options.heartbeat_s:
            return False  # liveness changes no faster than a heartbeat
        self._final_checked_at = now
        live = set(self.live_members(store))
        if self._final_state is not None:
            writer = store.get(FINAL_WRITER).decode() if store.check([FINAL_WRITER]) else ""
            if writer in live:
                return False
            if writer:
                logger.warning("fleet job %s: member %s, elected to write the final adapter, is gone; this member "
                               "writes it", self.job_id, writer)
            return self._write_final_if_elected(store, expected_writer=writer)
        holders = store.get(FINAL_HOLDERS).decode().split(",") if store.check([FINAL_HOLDERS]) else []
        if any(holder in live for holder in holders if holder):
            self._orphaned_since = None
            return False
        self._orphaned_since = self._orphaned_since if self._orphaned_since is not None else now
        if now - self._orphaned_since < self.options.dead_after_s + self.options.collective_timeout_s:
            return False
        self._error = FleetError(
            f"fleet job {self.job_id!r}: every step is committed but every member that held the finished weights "
            "is gone before the final adapter was written; the fleet's last checkpoint holds what it recorded. "
            "Restart the fleet (its store too) to train the rest from there")
        return True

    # -- every_step -----------------------------------------------------------------------
    def _form_group(self) -> None:
        """every_step: the group is every one of ``max_members`` members, fixed for the run
        (ranks in arrival order); waits for them at most ``collective_timeout_s``."""
        import datetime

        import torch.distributed as dist

        size = self.options.max_members
        rank = self.store.add("es/arrived", 1) - 1
        if rank >= size:
            raise FleetError(f"harvest.fleet.max_members: every_step runs exactly {size} member(s); this one came "
                             f"{rank + 1}th. Restart the whole fleet (every member) to change it")
        deadline = time.monotonic() + self.options.collective_timeout_s
        while self.store.add("es/arrived", 0) < size:
            if time.monotonic() > deadline:
                raise FleetError(f"harvest.fleet: every_step waits for {size} member(s); only "
                                 f"{self.store.add('es/arrived', 0)} came within {self.options.collective_timeout_s:g} s")
            time.sleep(POLL_S)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("es/pg/", self.store), rank, size,
                                           datetime.timedelta(seconds=self.options.collective_timeout_s))
        self.rank, self.size = rank, size
        self._stats.update(members=size)

    def sum_gradients(self, params, label_tokens: int, loss: float) -> tuple[float, int]:
        try:
            loss, total = averaging.sum_gradients(self.group, params, label_tokens, loss,
                                                  self.options.collective_timeout_s)
        except RuntimeError as error:  # gloo: a peer closed its connection, or the timeout passed
            raise FleetError(f"every_step: the gradient all-reduce failed ({error}); a member is gone. Restart every "
                             "member: they resume from the fleet's last checkpoint (rank 0 writes it)") from None
        self._stats["rounds"] += 1
        self._stats["round"] += 1
        self._stats["tokens_contributed"] += label_tokens
        self._committed_seen += 1
        self._last_round_mono = time.monotonic()
        return loss, total

    # -- inspection -----------------------------------------------------------------------
    def _eta_s(self) -> float | None:
        """The fleet's remaining steps at the fleet's pace since this member joined."""
        if self._joined_pace is None:
            return None
        since, committed_then = self._joined_pace
        done = self._committed_seen - committed_then
        if done <= 0:
            return None
        return (time.monotonic() - since) / done * max(0, self.total_steps - self._committed_seen)

    def stats(self) -> dict:
        """Attributes only, no store call: the server's status snapshot (the scheduler's
        thread) reads this."""
        stats = dict(self._stats)
        stats.update(member_id=self.member_id, job_id=self.job_id, sync=self.options.sync, joined=self.joined.is_set(),
                     rank=self.rank, staleness_s=(time.monotonic() - self._last_round_mono)
                     if self._last_round_mono is not None else None,
                     committed_steps=self._committed_seen, eta_s=self._eta_s(),
                     unsynced_steps=len(self.queue.unsynced) if self.queue is not None else 0,
                     total_steps=self.total_steps)
        return stats
