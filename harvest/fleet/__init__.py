"""One finetune job trained by many decode servers together (``harvest: {fleet: ...}``).

- :mod:`.options`: the job's ``harvest.fleet`` section.
- :mod:`.store`: the c10d TCPStore the members meet at (membership, rounds, the work queue).
- :mod:`.work`: which global steps each member trains (a shared queue: disjoint, complete,
  re-queued when a member dies).
- :mod:`.averaging`: the arithmetic of a round (token-weighted average, DiLoCo's outer
  step, every_step's gradient sum) over a torch.distributed gloo group.
- :mod:`.member`: a member: its heartbeat, its rounds, and what its trainer asks.
"""
