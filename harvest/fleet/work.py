"""Which global steps each member trains: a queue shared through the store.

Step ``t`` means the samples a one-process run trains at step ``t``. Members *claim* steps
one at a time, first from the re-queue (steps a dead or departed member had not synced),
then the next unused number (an atomic counter), so every step is claimed once, by
whichever member is free. Claimed steps stay *unsynced* until a round carries them into the
fleet's weights, then are *committed*; a dead member's unsynced steps (``claims/<member>``)
go back to the queue. Invariant: the committed steps are exactly those in the fleet's
weights, and every sample is trained once per epoch.
"""

from __future__ import annotations

import json

from harvest.fleet.store import FleetError

REQUEUE = "requeue"
NEXT = "next_step"
COMMITTED = "committed"
COMMITTED_STEPS = "committed_steps"
CHECKPOINTED = "checkpointed"  # the committed steps at the fleet's last checkpoint
ROUND = "round"
FINAL_HOLDERS = "final/holders"  # members that hold the finished job's weights ("a,b,")
FINAL_WRITER = "final/writer"  # the one of them that writes the final adapter (compare-set)
FINAL_WRITTEN = "final/written"  # set once the final adapter is on disk: members may finish


class StepQueue:
    def __init__(self, store, member_id: str, total_steps: int):
        self.store = store
        self.member_id = member_id
        self.total_steps = total_steps
        self.unsynced: list[int] = []  # claimed by this member, not in a completed round yet

    # -- set-up ---------------------------------------------------------------------------
    def initialize(self, fingerprint: dict, resumed: dict | None, timeout_s: float) -> bool:
        """The first member sets the queue up (from ``resumed``, a checkpoint's fleet state,
        if any); the others check they run the same job. True for the one that set it up."""
        claimed = self.store.compare_set("init", "", self.member_id).decode()
        text = json.dumps({"fingerprint": fingerprint, "total_steps": self.total_steps}, sort_keys=True)
        if claimed == self.member_id:
            done = expand_ranges((resumed or {}).get("committed_steps", []))
            following = max(done) + 1 if done else 0
            self.store.set("job", text)
            self.store.add(NEXT, following)
            self.store.add(COMMITTED, len(done))
            self.store.set(COMMITTED_STEPS, "".join(f"{s}," for s in sorted(done)))
            self.store.set(CHECKPOINTED, str(len(done)))
            self.store.set(ROUND, str(int((resumed or {}).get("round", 0))))
            for step in sorted(set(range(following)) - done):  # trained by members that had not synced
                self.store.queue_push(REQUEUE, str(step))
            self.store.set("ready", "1")
            return True
        self.store.wait(["ready"], _timedelta(timeout_s))
        theirs = self.store.get("job").decode()
        if theirs != text:
            raise FleetError(f"the fleet's job differs from this one: the fleet runs {theirs}, this member {text}; "
                             "members of one fleet job must use the same job settings")
        return False

    # -- claiming -------------------------------------------------------------------------
    def claim(self) -> int | None:
        """The next step for this member to train, or None when every step is claimed."""
        import torch.distributed as dist

        step = None
        try:
            step = int(self.store.queue_pop(REQUEUE, block=False))
        except dist.QueueEmptyError:
            number = self.store.add(NEXT, 1) - 1
            if number < self.total_steps:
                step = number
        if step is not None:
            self.unsynced.append(step)
            self._publish()
        return step

    def synced(self, steps: list[int]) -> None:
        """A round carried ``steps`` (this member's) into the fleet's weights."""
        done = set(steps)
        self.unsynced = [s for s in self.unsynced if s not in done]
        self.store.append(COMMITTED_STEPS, "".join(f"{s}," for s in sorted(done)))
        self.store.add(COMMITTED, len(done))
        self._publish()

    def give_back(self) -> list[int]:
        """Leaving: this member's unsynced steps go back to the queue for the others."""
        steps, self.unsynced = self.unsynced, []
        for step in steps:
            self.store.queue_push(REQUEUE, str(step))
        self.store.delete_key(f"claims/{self.member_id}")
        return steps

    def requeue_member(self, member_id: str) -> list[int]:
        """A dead member's unsynced steps back to the queue (once: the key is deleted)."""
        key = f"claims/{member_id}"
        if not self.store.check([key]):
            return []
        steps = json.loads(self.store.get(key))
        if not self.store.delete_key(key):
            return []
        for step in steps:
            self.store.queue_push(REQUEUE, str(step))
        return steps

    # -- reading --------------------------------------------------------------------------
    @property
    def committed(self) -> int:
        return self.store.add(COMMITTED, 0)

    @property
    def next_step(self) -> int:
        return min(self.store.add(NEXT, 0), self.total_steps)

    def committed_steps(self) -> list[int]:
        """Every step in the fleet's weights (what a checkpoint records)."""
        text = self.store.get(COMMITTED_STEPS).decode() if self.store.check([COMMITTED_STEPS]) else ""
        return sorted({int(part) for part in text.split(",") if part})

    @property
    def all_claimed(self) -> bool:
        return self.store.add(NEXT, 0) >= self.total_steps and self.store.queue_len(REQUEUE) == 0

    @property
    def finished(self) -> bool:
        return self.committed >= self.total_steps

    def _publish(self) -> None:
        self.store.set(f"claims/{self.member_id}", json.dumps(self.unsynced))


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def as_ranges(steps: list[int]) -> list[list[int]]:
    """Sorted steps as [first, last] ranges (a checkpoint's compact form)."""
    ranges: list[list[int]] = []
    for step in sorted(set(steps)):
        if ranges and step == ranges[-1][1] + 1:
            ranges[-1][1] = step
        else:
            ranges.append([step, step])
    return ranges


def expand_ranges(ranges) -> set[int]:
    return {step for first, last in ranges for step in range(int(first), int(last) + 1)}
