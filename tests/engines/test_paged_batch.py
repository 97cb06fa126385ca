"""The paged KV batch (``--kv paged``, harvest.engines.transformers.paged_batch): its step's
tokens and logits are the dense slot batch's (and each request's decoding alone) while
requests of different lengths join and leave; the page table's bookkeeping (pages freed and
reused, slots moving by their page tables, a clear error when the pool runs out); bad input
refused; the step reads nothing back to the host and serves through the graph step; the
compiled FlexAttention path (the one CUDA runs; on CPU its C++ template, which visits only
the page table's pages) decodes the same tokens. The ``[cuda]`` cases run where
gpu_validate.sh runs ``-m gpu``."""

from __future__ import annotations

import pytest

from harvest.engines.transformers.page_table import KvPoolExhausted, PageTable, check_page_size
from harvest.engines.transformers.paged_batch import PagedDecodeBatch
from harvest.engines.transformers.static_batch import SlotDecodeBatch
from tests.engines.helpers import DEVICES, emulated_graphs, model_on, solo_logits

PROMPTS = {1: [5 + 7 * j % 300 for j in range(5)], 2: [9 + 11 * j % 300 for j in range(9)], 3: [3, 4, 5],
           4: [200, 17, 33, 8], 5: [41, 42, 43, 44, 45, 46, 47]}
PAGE = {"cpu": 4, "cuda": 16}  # small pages on CPU: the short prompts span several


def run_script(batch, seen, tokens):
    """Joins, steps and leaves of requests of different lengths (the slot batch's write
    column wraps round its ring of 6 twice); each step's logits and next token per request."""

    def steps(count):
        for _ in range(count):
            batch.step()
            for slot, rid in enumerate(batch.request_ids):
                seen[rid].append(batch.last_logits[slot].float().cpu().clone())
                tokens[rid].append(int(batch.ids[slot, 0]))

    def join(*rids):
        batch.join(rids, [len(PROMPTS[r]) for r in rids], prompts=[PROMPTS[r] for r in rids])

    join(1)
    steps(2)
    join(2, 3)
    steps(2)
    batch.leave([1])  # slot 0 freed: request 3 (slot 2) moves there
    steps(3)
    join(4, 5)
    steps(1)
    batch.leave([2, 3])  # request 5 (slot 3) moves to slot 1
    steps(4)
    assert batch.request_ids == [4, 5]
    batch.leave([4, 5])


@pytest.mark.parametrize("device", DEVICES)
def test_paged_step_equals_the_dense_step(tiny_llama_path, device, one_thread):
    """The same joins, steps and leaves through the StaticCache slot batch and the paged
    batch: the same next tokens at every step, logits within fp32 tolerance, and both what
    each request gets decoding alone."""
    import torch

    model = model_on(tiny_llama_path, device)
    runs = {}
    for kind in ("dense", "paged"):
        if kind == "dense":
            batch = SlotDecodeBatch(model, device, 4, 9, 6, buckets=[1, 2])
        else:
            batch = PagedDecodeBatch(model, device, 4, 9, 6, buckets=[1, 2], page_size=PAGE[device])
            assert batch.max_length == 15 and batch.compiled is (device == "cuda")
        seen, tokens = ({rid: [] for rid in PROMPTS} for _ in range(2))
        run_script(batch, seen, tokens)
        runs[kind] = seen, tokens
        if kind == "paged":
            assert batch.table.used_pages == 0 and batch.table.free_pages == batch.num_pages
    (dense, dense_tokens), (paged, paged_tokens) = runs["dense"], runs["paged"]
    assert paged_tokens == dense_tokens
    assert [len(rows) for rows in paged.values()] == [4, 6, 6, 5, 5]
    for rid in PROMPTS:
        assert torch.allclose(torch.stack(paged[rid]), torch.stack(dense[rid]), atol=1e-5, rtol=1e-5), rid
        reference = solo_logits(model, PROMPTS[rid], len(paged[rid]), device)
        assert torch.allclose(torch.stack(paged[rid]), torch.stack(reference), atol=1e-4, rtol=1e-4), rid


def test_the_models_other_calls_keep_their_attention(tiny_llama_path, one_thread):
    """A paged batch routes the model's attention through harvest's dispatcher; a call
    without the paged step's keyword (a prefill, the trainer on the same weights, a padded
    batch with its 2D mask) computes exactly what the model's own implementation did."""
    import torch

    model = model_on(tiny_llama_path, "cpu")
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 3, 4, 5]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    base = model.config._attn_implementation
    with torch.inference_mode():
        before = model(input_ids=ids, attention_mask=mask).logits
        PagedDecodeBatch(model, "cpu", 2, 8, 2, page_size=4)
        after = model(input_ids=ids, attention_mask=mask).logits
    assert model.config._attn_implementation == f"harvest_paged+{base}"
    assert torch.equal(before, after)
    PagedDecodeBatch(model, "cpu", 2, 8, 2, page_size=4)  # a second batch on the switched model
    assert model.config._attn_implementation == f"harvest_paged+{base}"


def test_page_table_bookkeeping():
    table = PageTable(num_pages=6, page_size=4, num_rows=3, pages_per_row=3)
    assert table.reserve(0, 5) == [0, 1] and table.reserve(0, 8) == [] and table.capacity(0) == 8
    assert table.reserve_many({1: 9, 2: 1}) == {1: [2, 3, 4], 2: [5]}
    assert table.free_pages == 0 and table.used_pages == 6
    with pytest.raises(KvPoolExhausted, match=r"KV page pool exhausted: 1 more page\(s\) of 4 tokens wanted, 0 of 6 free"):
        table.reserve(2, 5)
    assert table.pages(2) == [5] and table.free_pages == 0  # nothing taken
    version = table.version
    assert table.release(0) == [0, 1] and table.free_pages == 2 and table.version > version
    table.move(2, 0)  # slot 2 moves into the hole: its page is now slot 0's
    assert table.pages(0) == [5] and table.pages(2) == []
    assert table.owners() == ([-1, -1, 1, 1, 1, 0], [0, 0, 0, 1, 2, 0])
    assert table.reserve(2, 8) == [0, 1]  # freed pages are reused, lowest first
    assert table.rows(fill=6) == [[5, 6, 6], [2, 3, 4], [0, 1, 6]]
    with pytest.raises(ValueError, match="a row holds at most 3"):
        table.reserve(1, 13)
    with pytest.raises(ValueError, match="still holds pages"):
        table.move(1, 2)
    with pytest.raises(IndexError, match="row 3 out of range"):
        table.release(3)


def test_pages_are_freed_reused_and_exhaustion_is_a_clear_error(tiny_llama_path, one_thread):
    """A pool of 5 pages of 4 tokens: requests take pages for their context and next token,
    one more as they fill a page, give them back when they leave; a join the pool cannot
    hold changes nothing, a step that needs a page the pool lacks says so, and the next
    step refuses to run without it. A slot that moves keeps its pages: no KV is copied."""
    import torch

    model = model_on(tiny_llama_path, "cpu")
    batch = PagedDecodeBatch(model, "cpu", 3, 8, 4, page_size=4, num_pages=5)
    assert batch.pages_per_request == 3 and batch.pool_tokens == (5 + 1) * 4  # one trash page for 3 slots
    batch.join([1, 2], [7, 3], prompts=[PROMPTS[5], PROMPTS[3]])
    assert [batch.table.pages(0), batch.table.pages(1)] == [[0, 1], [2]]
    assert batch.page_table[:2].tolist() == [[0, 1, 5], [2, 5, 5]]  # the device copy, filler = first trash page
    with pytest.raises(KvPoolExhausted, match="3 more page"):
        batch.join([3], [9 - 1], prompts=[[1] * 8])  # 8 tokens + the next: 3 pages, 2 free
    assert batch.request_ids == [1, 2] and batch.table.free_pages == 2
    batch.step()  # each fills its pages: one more each for the next token
    assert [batch.table.pages(0), batch.table.pages(1)] == [[0, 1, 3], [2, 4]] and batch.lengths == [8, 4]
    pools = [tensor.clone() for pair in batch.pools for tensor in pair]
    batch.leave([1])  # its pages come back; request 2 moves to slot 0 with its page table
    assert batch.request_ids == [2] and batch.table.pages(0) == [2, 4] and batch.table.free_pages == 3
    assert batch.page_table[0].tolist() == [2, 4, 5] and batch.page_owner.tolist() == [-1, -1, 0, -1, 0, -1]
    assert all(torch.equal(a, b) for a, b in zip(pools, [t for pair in batch.pools for t in pair]))
    batch.join([3], [6], prompts=[[11, 12, 13, 14, 15, 16]])  # request 1's pages, reused lowest first
    assert batch.table.pages(1) == [0, 1]
    for _ in range(2):
        batch.step()
    assert batch.table.pages(1) == [0, 1, 3] and batch.table.free_pages == 0
    reference = solo_logits(model, [11, 12, 13, 14, 15, 16], 2, "cpu")[1]
    assert torch.allclose(batch.last_logits[1], reference, atol=1e-4, rtol=1e-4)
    batch.step()
    with pytest.raises(KvPoolExhausted, match=r"1 more page\(s\) of 4 tokens wanted, 0 of 5 free"):
        batch.step()  # request 2's 8 tokens fill its pages: its next token needs one the pool lacks
    assert batch.lengths == [8, 10]
    with pytest.raises(KvPoolExhausted, match=r"slot\(s\) \[0\] have no page for their next token"):
        batch.step()
    batch.leave(list(batch.request_ids))
    assert batch.table.free_pages == 5 and batch.page_owner.tolist() == [-1] * 6


def test_bad_input_is_refused(tiny_llama_path):
    for page_size, message in ((6, "a power of two"), (0, "a positive number"), ("16", "a positive number")):
        with pytest.raises(ValueError, match=message):
            check_page_size(page_size)
    with pytest.raises(ValueError, match="at least 16 tokens on CUDA"):
        check_page_size(8, "cuda")
    model = model_on(tiny_llama_path, "cpu")
    with pytest.raises(ValueError, match="page_size=12: a power of two"):
        PagedDecodeBatch(model, "cpu", 2, 8, 4, page_size=12)
    with pytest.raises(ValueError, match=r"num_pages=2: at least one request's worth, 3 pages of 4 tokens \(12 tokens"):
        PagedDecodeBatch(model, "cpu", 2, 8, 4, page_size=4, num_pages=2)
    with pytest.raises(ValueError, match="max_steps=0: a positive integer"):
        PagedDecodeBatch(model, "cpu", 2, 8, 0, page_size=4)
    batch = PagedDecodeBatch(model, "cpu", 2, 8, 4, page_size=4)
    with pytest.raises(ValueError, match="exceeds max_context 8"):
        batch.join([1], [9])
    with pytest.raises(ValueError, match="3 requests join 0 in 2 slots"):
        batch.join([1, 2, 3], [2, 2, 2])
    with pytest.raises(ValueError, match="at least one token"):
        batch.join([1], [0])
    with pytest.raises(ValueError, match="prompts of"):
        batch.join([1], [3], prompts=[[1, 2]])
    with pytest.raises(ValueError, match="a bucket of 3 rows"):
        batch.add_bucket(3)
    assert batch.num_requests == 0 and batch.table.used_pages == 0
    batch.join([1], [8])
    for _ in range(4):
        batch.step()
    with pytest.raises(RuntimeError, match="outgrows its pages: 12 tokens, room for 12"):
        batch.step()
    with pytest.raises(RuntimeError, match="warm_buckets on a batch holding 1"):
        batch.warm_buckets()


def test_a_paged_decode_step_reads_nothing_back_to_the_host(tiny_llama_path, one_thread):
    """What would break a CUDA graph capture, outside the attention kernel (torch's flex
    kernel, compiled on CUDA): the write addresses, lengths, block counts, the model
    around them. The attention is a stand-in here (dynamo does not trace under a dispatch
    mode); it sees the pool and the block mask the step built."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.engines.test_transformers_batches import HOST_READS

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in HOST_READS:
                self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    batch = PagedDecodeBatch(model_on(tiny_llama_path, "cpu"), "cpu", 4, 8, 4, buckets=[2], page_size=4)
    calls = []

    def attention(query, key, value, block_mask, scale, enable_gqa):
        calls.append((tuple(query.shape), tuple(key.shape), block_mask.kv_num_blocks[:, 0, 0].clone()))
        return query.clone()

    batch.join([1], [5])
    batch._flex = attention
    with HostReads() as mode:
        for bucket in (2, 4, 2):
            batch.decode_step(bucket)
    assert mode.seen == []
    pool = (1, 2, batch.pool_tokens, 16)
    assert len(calls) == 3 * 2  # every layer, every step: 6, 7 then 8 tokens in 2 pages of 4
    assert [(q, k, blocks.tolist()) for q, k, blocks in calls[::2]] == [
        ((2, 4, 1, 16), pool, [2, 0]), ((4, 4, 1, 16), pool, [2, 0, 0, 0]), ((2, 4, 1, 16), pool, [2, 0])]
    assert batch.positions[:, 0].tolist() == [8, 0, 0, 0]  # inactive rows stay put
    assert torch.equal(batch.write_addr[1:], batch.trash_addr[1:])  # and write to the trash page


def test_graph_step_serves_a_paged_batch(tiny_llama_path, one_thread):
    """The graphs-on serving step over a paged batch: (emulated) graphs captured per (level,
    bucket) on the empty batch replay the chosen level's graph for the batch's bucket, with
    the page bookkeeping between steps, and decode what the eager paged step decodes."""
    import torch

    from harvest.engines.transformers.graph_step import GraphStep, capture_serving_graphs
    from harvest.ladder import GREEN_CONTEXTS, Ladder, Level

    class Partitioner:
        ladder = Ladder(2, (Level(1, 1), Level(2, 0)), GREEN_CONTEXTS)
        current_index = 0

    model = model_on(tiny_llama_path, "cpu")
    runs = {}
    for graphs_on in (True, False):
        batch = PagedDecodeBatch(model, "cpu", 4, 8, 6, buckets=[2], page_size=4)
        graphs = emulated_graphs()(Partitioner.ladder.levels)
        if graphs_on:
            report = capture_serving_graphs(batch, graphs, Partitioner.ladder)
            assert report["captured"] == 4 and batch.num_requests == 0 and batch.table.used_pages == 0
        step, rows = GraphStep(batch, graphs, Partitioner()), []
        batch.join([1, 2], [6, 3], prompts=[PROMPTS[5][:6], PROMPTS[3]])
        for joining in ([3], []):  # buckets 2, then 4; request 2 crosses a page boundary
            for _ in range(3):
                step()
                rows.append(batch.last_logits[:batch.num_requests].clone())
            if joining:
                batch.join(joining, [4], prompts=[PROMPTS[4]])
        runs[graphs_on] = rows, step.graph_steps, step.eager_steps
    assert runs[True][1:] == (6, 0) and runs[False][1:] == (0, 6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(runs[True][0], runs[False][0]))


@pytest.mark.slow
def test_compiled_paged_step_decodes_what_each_request_decodes_alone(tiny_llama_path, one_thread):
    """FlexAttention through torch.compile, the path CUDA runs: on CPU inductor's C++ flex
    template, which (like the Triton decode kernel) visits only the pages the block mask
    lists, so a wrong page table or block count shows here (the eager reference masks the
    whole pool instead). One bucket: one compilation (tens of seconds)."""
    import torch

    model = model_on(tiny_llama_path, "cpu")
    batch = PagedDecodeBatch(model, "cpu", 4, 9, 6, page_size=4, compiled=True)
    seen, tokens = {rid: [] for rid in PROMPTS}, {rid: [] for rid in PROMPTS}
    run_script(batch, seen, tokens)
    for rid in PROMPTS:
        reference = solo_logits(model, PROMPTS[rid], len(seen[rid]), "cpu")
        assert torch.allclose(torch.stack(seen[rid]), torch.stack(reference), atol=1e-4, rtol=1e-4), rid


def test_profilers_paged_engine_runs_each_grid_point_on_one_paged_batch(tiny_llama_path, one_thread):
    """`harvest profile --engine transformers --kv paged` (eager on CPU): a grid point's
    requests join one paged batch with pages for every step the point takes; each step
    reports the pages its attention reads; a rewind replays the same tokens (what the
    graphs-on engine does after its capture); the next point reuses the batch with its own
    bucket, and releasing a point gives its pages back."""
    from harvest.predict.profiler.engines import EngineConfig, EngineError
    from harvest.predict.profiler.hf_engine import TransformersDecodeEngine

    config = EngineConfig(str(tiny_llama_path), "cpu", "float32", False, 4, 64, steps_per_point=5, kv="paged",
                          page_size=4)
    engine = TransformersDecodeEngine(config)
    engine.prepare(3, 10)
    batch = engine._paged
    assert batch.num_requests == 3 and batch.buckets == [3, 4] and batch.table.used_pages == 3 * 4  # 15 tokens each
    sums = []
    for _ in range(5):
        sums.append(engine.begin_step())
        engine.step()
    assert sums == [3 * 12.0, 3 * 12.0, 3 * 16.0, 3 * 16.0, 3 * 16.0]  # 11..15 tokens read, in pages of 4
    with pytest.raises(EngineError, match="more than the 5 steps it has pages for"):
        engine.begin_step()
    decoded = batch.ids[:3].clone()
    batch.rewind()
    assert batch.lengths == [10, 10, 10]
    for _ in range(5):
        batch.decode_step(3)
    assert batch.ids[:3].tolist() == decoded.tolist()
    engine.prepare(2, 6)
    assert engine._paged is batch and batch.buckets == [2, 3, 4] and batch.table.used_pages == 2 * 3
    engine.close()
    assert batch.table.used_pages == 0 and engine._paged is None


@pytest.mark.gpu
def test_profilers_paged_graph_steps_decode_what_eager_paged_steps_decode(tiny_llama_path):
    """`--kv paged --graphs on`: the grid point's step is captured (compiled FlexAttention
    inside) and replayed; it decodes what the same batch decodes eagerly after a rewind."""
    import torch

    from harvest.predict.profiler.engines import EngineConfig
    from harvest.predict.profiler.hf_engine import TransformersDecodeEngine

    config = EngineConfig(str(tiny_llama_path), "cuda:0", "float32", False, 4, 64, graphs=True, steps_per_point=6,
                          kv="paged", page_size=16)
    engine = TransformersDecodeEngine(config)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        engine.prepare(4, 30)
        sums = []
        for _ in range(5):
            sums.append(engine.begin_step())
            engine.step()
        stream.synchronize()
        batch = engine._paged
        replayed = batch.ids[:4].clone()
        batch.rewind()
        for _ in range(5):
            batch.decode_step(4)
        stream.synchronize()
    assert torch.equal(replayed, batch.ids[:4])
    assert sums == [4 * 32.0, 4 * 32.0, 4 * 48.0, 4 * 48.0, 4 * 48.0]  # 31..35 tokens in pages of 16
    engine.close()
