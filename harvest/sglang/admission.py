"""What SGLang 0.5.23's admission is about to set aside, read before each admission round
(``Scheduler.get_new_batch_prefill``) for the lending controller
(:meth:`~harvest.sglang.kv_lending.KvLendingController.before_admission`).

SGLang admits a queued request only when its prompt, its clipped ``max_new_tokens`` and a
page fit in the free slots (plus what its cache could evict) beside what it has set aside
for every running request's remaining decode (``PrefillAdder``: ``remaining_total``). So
free slots a lent chunk took are an admission's business twice: the running requests'
promise must stay free or nothing new is admitted, and a queue head that would have fitted
had nothing been lent is held back by lent memory. The figures here mirror SGLang's
arithmetic and err high (no prefix match is counted, and the queue is taken in its
arrival order up to the round's limits): taking back a chunk too many costs a re-lend
later, one too few an admission's wait.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AdmissionDemand:
    looked: bool  # SGLang looks at its queue this round, or it is empty (False: skipped, its batch is full)
    queued_tokens: int  # what admitting the queue's head would set aside (0: nothing queued)
    promised_tokens: int  # what SGLang sets aside for its running requests' remaining decode
    evictable_tokens: int = 0  # what its prefix cache could free before it needs lent memory
    arrived_tokens: int = 0  # the requests new in the queue since the last round, as admission prices them


def _clip():
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    return CLIP_MAX_NEW_TOKENS


def _remaining(req, clip: int) -> int:
    return min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), clip)


def _priced(req, clip: int) -> int:
    """What admitting ``req`` sets aside: its prompt (and any output it had before a
    retraction), its remaining clipped ``max_new_tokens`` and a page."""
    return len(req.origin_input_ids) + len(req.output_ids) + _remaining(req, clip) + 1


def arrivals(waiting, seen: set) -> int:
    """The tokens of the requests in ``waiting`` not in it at the last call (``seen``,
    updated: the queue's request ids), as admission prices them: the demand the auto
    reserve follows with reclaim ahead (a request retracted and queued again arrives
    again: it needs its memory again)."""
    if not waiting:
        seen.clear()
        return 0
    clip = _clip()
    now = {req.rid for req in waiting}
    arrived = sum(_priced(req, clip) for req in waiting if req.rid not in seen)
    seen.clear()
    seen.update(now)
    return arrived


def promised_tokens(running_batch, new_token_ratio: float) -> int:
    """SGLang's set-aside for its running requests' decode (``PrefillAdder``'s
    ``_get_running_request_total_token_offset``: ratio 1 for ``ignore_eos`` requests)."""
    reqs = getattr(running_batch, "reqs", None) or ()
    if not reqs:
        return 0
    clip = _clip()
    total = 0.0
    for req in reqs:
        total += _remaining(req, clip) * (1.0 if req.sampling_params.ignore_eos else new_token_ratio)
    return int(total + 0.999999)


def demand_of(scheduler, running_batch, *, promised: bool = True, seen: set | None = None) -> AdmissionDemand:
    """The admission round SGLang is about to run. ``promised``: work out the running
    requests' set-aside even with nothing queued (reclaim ahead keeps it free); ``seen``:
    the queue's request ids at the last round, to count :func:`arrivals` (None: not
    counted)."""
    waiting = scheduler.waiting_queue
    arrived = 0 if seen is None else arrivals(waiting, seen)
    if not waiting and not promised:
        return AdmissionDemand(True, 0, 0)
    reqs = getattr(running_batch, "reqs", None) or ()
    full = bool(getattr(running_batch, "batch_is_full", False)) and len(reqs) > 0 and scheduler.chunked_req is None
    looked = not (waiting and full)
    if not looked and not promised:
        return AdmissionDemand(False, 0, 0)
    ratio = scheduler.new_token_ratio_tracker.current
    promise = promised_tokens(running_batch, ratio)
    if not looked or not waiting:
        return AdmissionDemand(looked, 0, promise, arrived_tokens=arrived)
    clip = _clip()
    room = max(0, int(scheduler.max_running_requests) - len(reqs))
    input_budget = int(getattr(scheduler, "max_prefill_tokens", 0) or 0)
    queued = inputs = 0
    for req in waiting[:room]:
        prompt = len(req.origin_input_ids) + len(req.output_ids)
        if queued and input_budget and inputs + prompt > input_budget:
            break  # beyond one round's prefill budget (the first request is always looked at)
        inputs += prompt
        queued += _priced(req, clip)
    evictable = 0
    tree_cache = getattr(scheduler, "tree_cache", None)
    if tree_cache is not None and hasattr(tree_cache, "evictable_size"):
        evictable = int(tree_cache.evictable_size())
    return AdmissionDemand(True, queued, promise, evictable, arrived)
