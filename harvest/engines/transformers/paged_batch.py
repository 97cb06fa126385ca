"""A decode batch whose KV lives in pages (``--kv paged``): the interface of
:class:`~.static_batch.SlotDecodeBatch` (requests join and leave fixed slots, a step runs
on the smallest bucket of rows holding them, capturable per (ladder level, bucket)), with
the attention of a step reading only each request's real context.

Layout (docs/design.md §4, 'Paged KV in the transformers engine'): every layer's KV is
one pool of ``num_pages`` pages of ``page_size`` tokens (plus one trash page per
``page_size`` slots, where inactive rows write); slot s's page table lists its pages in
order (:class:`~.page_table.PageTable` on the host, a device copy refreshed on every
change), and :mod:`.paged_attention` runs the step's attention as FlexAttention over those
pages only. A request holds pages for its tokens and the next one: a join takes them for
its context, :meth:`PagedDecodeBatch.after_step` one more page when a request fills its
last, a leave gives them back (and the last slots move into the holes by their page
tables alone: no KV is copied). The step itself (:meth:`PagedDecodeBatch.decode_step`)
computes each row's write address and length from its position on the device, so it
keeps fixed shapes and addresses and reads nothing back to the host.

torch and transformers are imported by the class, not by this module.
"""

from __future__ import annotations

from harvest.engines.transformers.model import cache_layers
from harvest.engines.transformers.page_table import KvPoolExhausted, PageTable, check_page_size, pages_for
from harvest.engines.transformers.paged_attention import FLEX_KWARG
from harvest.engines.transformers.static_batch import SlotRows

DEFAULT_PAGE_SIZE = 16


class PagedDecodeBatch(SlotRows):
    """Requests decoding together in ``max_batch_size`` slots over a paged KV pool. Each
    slot computes what it would decoding alone; a request holds at most ``max_context +
    max_steps`` tokens; ``num_pages`` (default: every slot at that length) bounds the
    pool, a join or step needing more pages than are free raises
    :class:`~.page_table.KvPoolExhausted`. ``compiled``: flex_attention through
    torch.compile (default: on CUDA; eager, torch's exact reference, on CPU)."""

    def __init__(self, model, device, max_batch_size: int, max_context: int, max_steps: int, *, buckets=None,
                 seed: int = 0, page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None,
                 compiled: bool | None = None):
        import torch

        from harvest.engines.transformers import paged_attention as paged

        self._torch = torch
        config = model.config
        self.model, self.config, self.device = model, config, torch.device(device)
        for name, value in (("max_batch_size", max_batch_size), ("max_context", max_context), ("max_steps", max_steps)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: a positive integer")
        check_page_size(page_size, self.device.type)
        self.max_batch_size, self.max_context, self.max_steps = max_batch_size, max_context, max_steps
        self.max_length = max_context + max_steps
        self.page_size = page_size
        self.pages_per_request = pages_for(self.max_length, page_size)
        if num_pages is None:
            num_pages = max_batch_size * self.pages_per_request
        if not isinstance(num_pages, int) or num_pages < self.pages_per_request:
            raise ValueError(f"num_pages={num_pages!r}: at least one request's worth, {self.pages_per_request} pages "
                             f"of {page_size} tokens ({self.max_length} tokens: max_context + max_steps)")
        self.table = PageTable(num_pages, page_size, max_batch_size, self.pages_per_request)
        self.num_pages = num_pages
        total_pages = num_pages + pages_for(max_batch_size, page_size)  # the trash pages after the pool's
        self.pool_tokens = total_pages * page_size
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.buckets = sorted({b for b in (buckets or ()) if 0 < b < max_batch_size} | {max_batch_size})
        self.compiled = self.device.type == "cuda" if compiled is None else bool(compiled)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        paged.use_paged_attention(model)
        self._flex = paged.flex_function(self.compiled)
        rows = max_batch_size
        long, int32 = dict(dtype=torch.long, device=self.device), dict(dtype=torch.int32, device=self.device)
        with torch.inference_mode():
            shape = (1, self.kv_heads, self.pool_tokens, self.head_dim)
            self.pools = [(torch.zeros(shape, dtype=model.dtype, device=self.device),
                           torch.zeros(shape, dtype=model.dtype, device=self.device))
                          for _ in range(config.num_hidden_layers)]
            self.ids = torch.zeros((rows, 1), **long)
            self.first_ids = torch.zeros((rows, 1), **long)  # each slot's first decode input (rewind)
            self.positions = torch.zeros((rows, 1), **long)  # tokens each slot holds: the new token's position
            self.active = torch.zeros((rows,), **long)  # 1 for the slots [0, num_requests)
            self.write_addr = torch.zeros((rows,), **long)  # the pool column of each row's new token
            self.trash_addr = torch.arange(rows, **long) + num_pages * page_size  # inactive rows write there
            self.kv_len = torch.zeros((rows,), **int32)  # tokens a row's query sees (the new one included)
            self.kv_num_blocks = torch.zeros((rows, 1, 1), **int32)
            self.kv_indices = torch.full((rows, 1, 1, total_pages), num_pages, **int32)  # page tables, then filler
            self.page_table = self.kv_indices[:, 0, 0, :self.pages_per_request]  # a view: slot -> its pages
            self.page_owner = torch.full((total_pages,), -1, **int32)
            self.page_logical = torch.zeros((total_pages,), **int32)
            self.last_logits = torch.zeros((rows, config.vocab_size), dtype=model.dtype, device=self.device)
            self._mask_mod = paged.page_mask_mod(self.page_owner, self.page_logical, self.kv_len, page_size)
        self._views = {b: self._bucket_view(b) for b in self.buckets}
        self._synced = self.table.version
        self._staged = self._staged_done = None  # CUDA: pinned host copies of the page tables, their copy's event
        self.request_ids: list[int] = []  # slot i holds request_ids[i]
        self.lengths: list[int] = []  # tokens each active slot holds in the KV cache
        self.steps_taken: list[int] = []  # steps each active slot has decoded
        self.context_lengths: list[int] = []  # each active slot's length when it joined (rewind)

    # -- what a step computes ------------------------------------------------------------------
    def padded_sum_context(self) -> int:
        """The step's attention work: the pages each request's query reads (inactive rows
        of the bucket read none)."""
        size = self.page_size
        return sum(pages_for(length + 1, size) * size for length in self.lengths)

    # -- host work between steps ---------------------------------------------------------------
    def join(self, request_ids, context_lengths, prompts=None) -> None:
        """Requests holding ``context_lengths`` tokens of KV into the next free slots, with
        pages for them and their next token: random values, or (tests) the prefill of
        ``prompts`` (lists of token ids), each alone through the model (eager, on the
        caller's stream). Nothing changes when the pool lacks the pages."""
        torch = self._torch
        request_ids, context_lengths = list(request_ids), list(context_lengths)
        if self.num_requests + len(request_ids) > self.max_batch_size:
            raise ValueError(f"{len(request_ids)} requests join {self.num_requests} in {self.max_batch_size} slots")
        if max(context_lengths, default=0) > self.max_context:
            raise ValueError(f"a context of {max(context_lengths)} tokens exceeds max_context {self.max_context}")
        if min(context_lengths, default=1) < 1:
            raise ValueError("a request joins with at least one token of context")
        if prompts is not None and [len(p) for p in prompts] != context_lengths:
            raise ValueError(f"prompts of {[len(p) for p in prompts]} tokens, context lengths {context_lengths}")
        first = self.num_requests
        self.table.reserve_many({first + i: length + 1 for i, length in enumerate(context_lengths)})
        with torch.inference_mode():
            for i, length in enumerate(context_lengths):
                slot = first + i
                addr = self._addresses(slot, length)
                if prompts is None:
                    for keys, values in self.pools:
                        for pool in (keys, values):
                            noise = torch.randn((self.kv_heads, length, self.head_dim), generator=self.generator,
                                                device=self.device, dtype=pool.dtype)
                            pool[0].index_copy_(1, addr, noise)
                    self.ids[slot].random_(0, self.config.vocab_size, generator=self.generator)
                else:
                    out = self.model(input_ids=torch.tensor([prompts[i]], device=self.device), use_cache=True)
                    for (keys, values), (new_keys, new_values) in zip(self.pools, cache_layers(out.past_key_values)):
                        keys[0].index_copy_(1, addr, new_keys[0].to(keys.dtype))
                        values[0].index_copy_(1, addr, new_values[0].to(values.dtype))
                    self.ids[slot].copy_(out.logits[0, -1].argmax(-1, keepdim=True))
                self.positions[slot].fill_(length)
            self.first_ids[first:first + len(request_ids)].copy_(self.ids[first:first + len(request_ids)])
            self.active[:first + len(request_ids)].fill_(1)
        self.request_ids += request_ids
        self.lengths += context_lengths
        self.context_lengths += context_lengths
        self.steps_taken += [0] * len(request_ids)
        self._sync_pages()

    def leave(self, request_ids) -> None:
        """Free the slots of ``request_ids`` and their pages: the last active slots move
        into the holes (their page tables, token ids, positions), so the active ones stay
        first; no KV moves."""
        torch = self._torch
        gone = set(request_ids)
        keep = [slot for slot, rid in enumerate(self.request_ids) if rid not in gone]
        count = len(keep)
        holes = [slot for slot in range(count) if self.request_ids[slot] in gone]
        movers = [slot for slot in keep if slot >= count]
        for slot, rid in enumerate(self.request_ids):
            if rid in gone:
                self.table.release(slot)
        for hole, mover in zip(holes, movers):
            self.table.move(mover, hole)
        with torch.inference_mode():
            if holes:
                dst, src = (torch.tensor(s, device=self.device) for s in (holes, movers))
                for tensor in (self.ids, self.first_ids, self.positions, self.last_logits):
                    tensor.index_copy_(0, dst, tensor.index_select(0, src))
            self.active[count:].fill_(0)
            self.positions[count:].fill_(0)
        order = list(range(self.num_requests))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        order = order[:count]
        self.request_ids = [self.request_ids[s] for s in order]
        self.lengths = [self.lengths[s] for s in order]
        self.context_lengths = [self.context_lengths[s] for s in order]
        self.steps_taken = [self.steps_taken[s] for s in order]
        self._sync_pages()

    def after_step(self) -> None:
        """Host bookkeeping of a step that ran (eager or a graph's replay): one token more
        per request, and a page more for a request whose pages are full (its next token)."""
        self.lengths = [length + 1 for length in self.lengths]
        self.steps_taken = [taken + 1 for taken in self.steps_taken]
        self.table.reserve_many({slot: length + 1 for slot, length in enumerate(self.lengths)
                                 if length < self.max_length})
        self._sync_pages()

    def add_bucket(self, rows: int) -> None:
        """A step of exactly ``rows`` rows from now on (host work: its cache and block mask
        views; with compiled attention, its first step compiles that shape)."""
        if not 0 < rows <= self.max_batch_size:
            raise ValueError(f"a bucket of {rows} rows: 1..{self.max_batch_size}")
        if rows not in self._views:
            self._views[rows] = self._bucket_view(rows)
            self.buckets = sorted(self._views)

    def warm_buckets(self) -> None:
        """One step of every bucket on an empty batch (with compiled attention: every
        shape compiled now, not in the first step that needs it); nothing changes."""
        if self.num_requests:
            raise RuntimeError(f"warm_buckets on a batch holding {self.num_requests} requests")
        for rows in self.buckets:
            self.decode_step(rows)

    def reserve_ahead(self, steps: int) -> None:
        """Pages for ``steps`` more tokens of every request now (so that steps run without
        :meth:`after_step` between them, e.g. a captured step's warm-up and capture)."""
        self.table.reserve_many({slot: min(length + steps, self.max_length)
                                 for slot, length in enumerate(self.lengths)})
        self._sync_pages()

    def check_room(self) -> None:
        """Before a step: every request has room, and a page, for its next token."""
        if self.lengths and max(self.lengths) >= self.max_length:
            raise RuntimeError(f"a request outgrows its pages: {max(self.lengths)} tokens, room for "
                               f"{self.max_length} (max_context + max_steps)")
        short = [slot for slot, length in enumerate(self.lengths) if self.table.capacity(slot) <= length]
        if short:
            raise KvPoolExhausted(f"slot(s) {short} have no page for their next token (the pool ran out at the "
                                  "previous step)")

    def rewind(self) -> None:
        """Every request back to its length and next token when it joined (the tokens
        decoded since are dropped; their pages stay): the steps after a rewind compute what
        the steps after the join did. On the current stream."""
        torch = self._torch
        with torch.inference_mode():
            count = self.num_requests
            self.ids[:count].copy_(self.first_ids[:count])
            self.positions[:count, 0].copy_(torch.tensor(self.context_lengths, dtype=torch.long))
        self.lengths = list(self.context_lengths)
        self.steps_taken = [0] * self.num_requests

    # -- the step ---------------------------------------------------------------------------
    def decode_step(self, bucket: int | None = None) -> None:
        """One token for slots ``[0, bucket)`` (all by default), on the current stream;
        capturable (no host read, fixed addresses)."""
        torch = self._torch
        rows = self.max_batch_size if bucket is None else bucket
        cache, block_mask = self._views[rows]
        size = self.page_size
        with torch.inference_mode():
            positions, active = self.positions[:rows], self.active[:rows]
            position = positions[:, 0]
            page_index = torch.clamp(position // size, max=self.pages_per_request - 1).unsqueeze(1)
            page = self.page_table[:rows].gather(1, page_index)[:, 0].long()
            self.write_addr[:rows].copy_(torch.where(active.bool(), page * size + position % size, self.trash_addr[:rows]))
            self.kv_len[:rows].copy_((position + 1) * active)
            self.kv_num_blocks[:rows, 0, 0].copy_((self.kv_len[:rows] + size - 1) // size)
            out = self.model(input_ids=self.ids[:rows], past_key_values=cache, attention_mask=block_mask,
                             position_ids=positions, use_cache=True, logits_to_keep=1, **{FLEX_KWARG: self._flex})
            logits = out.logits[:, -1, :]
            self.last_logits[:rows].copy_(logits)
            self.ids[:rows].copy_(logits.argmax(dim=-1, keepdim=True))
            positions.add_(active.unsqueeze(1))

    # -- helpers ------------------------------------------------------------------------------
    def _bucket_view(self, rows: int):
        """(cache, block mask) of slots ``[0, rows)``: views of the batch's tensors."""
        from harvest.engines.transformers import paged_attention as paged

        return (paged.paged_cache(self.pools, self.write_addr[:rows]),
                paged.paged_block_mask(self.kv_num_blocks[:rows], self.kv_indices[:rows], self._mask_mod, self.page_size,
                                       self.pool_tokens))

    def _addresses(self, slot: int, length: int):
        """Pool columns of slot ``slot``'s first ``length`` tokens."""
        pages, size = self.table.pages(slot), self.page_size
        columns = [pages[t // size] * size + t % size for t in range(length)]
        return self._torch.tensor(columns, dtype=self._torch.long, device=self.device)

    def _sync_pages(self) -> None:
        """The device's page tables, owners and logical indices from the host's, when they
        changed, on the current stream. On CUDA through pinned staging buffers, without
        waiting for the copy (a step's ``after_step`` runs inside the timed step): only the
        next refresh waits, until the previous copy has read them."""
        if self._synced == self.table.version:
            return
        torch = self._torch
        owners, logical = self.table.owners()
        values = (self.table.rows(fill=self.num_pages), owners, logical)
        targets = (self.page_table, self.page_owner[:self.num_pages], self.page_logical[:self.num_pages])
        with torch.inference_mode():
            if self.device.type != "cuda":
                for target, value in zip(targets, values):
                    target.copy_(torch.tensor(value, dtype=torch.int32))
            else:
                if self._staged is None:
                    self._staged = [torch.empty(t.shape, dtype=torch.int32, pin_memory=True) for t in targets]
                elif self._staged_done is not None:
                    self._staged_done.synchronize()
                for staged, target, value in zip(self._staged, targets, values):
                    staged.copy_(torch.tensor(value, dtype=torch.int32))
                    target.copy_(staged, non_blocking=True)
                self._staged_done = torch.cuda.Event()
                self._staged_done.record()
        self._synced = self.table.version
