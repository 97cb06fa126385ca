"""The ``harvest.fleet`` section of a job: which fleet the job belongs to and how it syncs."""

from __future__ import annotations

import dataclasses

from harvest import addresses
from harvest.settings import Endpoint, Integer, Number, Text, invalid, setting, validate
from harvest.setting_kinds import NAME_EXPECTED, NAME_PATTERN

SYNC_RULES = ("periodic", "every_step")
OUTER_OPTIMIZERS = ("average", "nesterov")


@dataclasses.dataclass(frozen=True)
class FleetOptions:
    """Absent (``rendezvous: null``): the job trains alone. Otherwise every server (or
    ``harvest train`` process) whose job names the same ``rendezvous`` and ``job_id``
    trains it together with the others."""

    rendezvous: str | None = setting(None, "HOST:PORT of the fleet's c10d TCPStore (membership, rounds and the shared "
                                     "work queue); null: not a fleet job", Endpoint(),
                                     nullable=True)
    job_id: str | None = setting(None, "the fleet job's id in the store (null: the job's name); members of one job "
                                 "must agree", Text(NAME_PATTERN, NAME_EXPECTED), nullable=True)
    host_store: str = setting("auto", "auto: host the store when HOST is this machine and the port is free (the first "
                              "member to start hosts it); never: only connect (a `harvest fleet-store` process hosts it)",
                              Text("auto|never", "auto or never"))
    min_members: int = setting(1, "a round averages only once at least this many members are in it (fewer: they train on alone and wait)",
                               Integer(minimum=1))
    max_members: int = setting(64, "members at most; a further member is refused at start", Integer(minimum=1))
    sync: str = setting("periodic", "periodic: local steps, then the LoRA weights averaged by tokens trained (local "
                        "SGD); every_step: gradients all-reduced every optimizer step (exact data parallelism, a fixed "
                        "group of max_members, for validation)", Text("periodic|every_step", "periodic or every_step"))
    sync_interval_s: float = setting(30.0, "periodic: seconds of training between rounds",
                                     Number(minimum=0.0, exclusive_minimum=True))
    outer_optimizer: str = setting("average", "periodic: average (the round's weighted mean becomes the weights) or "
                                   "nesterov (DiLoCo's outer step on the mean's change)",
                                   Text("average|nesterov", "average or nesterov"))
    outer_lr: float = setting(0.7, "nesterov: the outer learning rate (DiLoCo: 0.7)",
                              Number(minimum=0.0, exclusive_minimum=True))
    outer_momentum: float = setting(0.9, "nesterov: the outer momentum (DiLoCo: 0.9)", Number(minimum=0.0))
    heartbeat_s: float = setting(1.0, "how often a member says it is alive", Number(minimum=0.0, exclusive_minimum=True))
    dead_after_s: float = setting(10.0, "a member silent this long is dropped, and the steps it had not synced are "
                                  "trained again by the others", Number(minimum=0.0, exclusive_minimum=True))
    collective_timeout_s: float = setting(60.0, "a round's all-reduce, and every_step's group forming, give up after "
                                          "this long", Number(minimum=0.0, exclusive_minimum=True))

    def __post_init__(self) -> None:
        validate(self)
        if self.max_members < self.min_members:
            raise invalid(self, "max_members", f"at least min_members ({self.min_members})")
        if self.dead_after_s <= self.heartbeat_s:
            raise invalid(self, "dead_after_s", f"more than heartbeat_s ({self.heartbeat_s:g})")

    @property
    def enabled(self) -> bool:
        return self.rendezvous is not None

    @property
    def host_port(self) -> tuple[str, int]:
        address = addresses.parse_address(self.rendezvous)  # valid: checked in __post_init__
        return address.host, address.port
