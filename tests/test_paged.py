"""A paged global K,V decodes exactly as rows per position do, holds only the pages its
sequences reach, and says so when its pool runs out."""

import warnings

import pytest
import torch

import archlab
from archlab.block import ceil_div
from archlab.engine import Engine
from archlab.kv import CacheFull, KVRows, PagedKV, PageTable
from archlab.spec import YocoLayout
from conftest import ROOT, TINY

YOCO = [p for p in TINY if isinstance(archlab.load_spec(p).layout, YocoLayout)]


def paged_copy(k, v, page_size, order, kernel="torch"):
    """The rows k, v [B, M, Hkv, Dh] in a pool, pages handed out in the order the (row, length)
    steps of ``order`` reach them, so rows' pages interleave."""
    rows, length, heads, dim = k.shape
    pages = rows * ceil_div(length, page_size)
    table = PageTable(rows, pages, page_size, length, kernel=kernel)
    pool_k, pool_v = (torch.zeros(heads, pages + 1, page_size, dim, dtype=k.dtype) for _ in "kv")
    for row, end in order:
        ends = table.held * page_size
        ends[row] = end
        table.reserve(ends, span=length)
    positions = torch.arange(length)[None].expand(rows, -1)
    table.write(positions, (pool_k, k), (pool_v, v))
    return PagedKV(pool_k, pool_v, table)


@pytest.mark.parametrize("page_size", [1, 5, 16, 64])
@pytest.mark.parametrize("queries, kernel", [(1, "torch"), (1, "flex"), (3, "torch")])
def test_paged_attention_equals_attention_over_rows(page_size, queries, kernel):
    """One query per row (split by page, or FlexAttention) and a block of queries (pages
    gathered), with GQA and each row at its own position, against the same keys as rows, in
    float64."""
    rows, length, kv_heads, heads, dim = 3, 40, 2, 6, 8
    k, v = (torch.randn(rows, length, kv_heads, dim, dtype=torch.float64) for _ in "kv")
    q = torch.randn(rows, queries, heads, dim, dtype=torch.float64)
    q_pos = torch.tensor([[39], [17], [4]]) - torch.arange(queries - 1, -1, -1)[None]
    order = [(r, end) for end in range(page_size, length + page_size, page_size) for r in (2, 0, 1)]
    paged = paged_copy(k, v, page_size, order, kernel)
    expected = KVRows(k, v, torch.arange(length)[None]).attend(q, q_pos)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        torch.testing.assert_close(paged.attend(q, q_pos), expected, rtol=1e-12, atol=1e-12)


def read_by_cuda_decoding(blocks: torch.Tensor, counts: torch.Tensor, partial: torch.Tensor, row: int) -> set[int]:
    """The blocks CUDA's FlexAttention decoding kernel reads from the list ``blocks`` for a query
    row: it finds the full blocks' list, as the partial ones', at the partial list's row offset
    and wraps it at that list's width (torch/_inductor/kernel/flex/templates/flex_decode.py.jinja)."""
    assert blocks.is_contiguous() and partial.is_contiguous()
    flat = blocks.flatten()
    return {int(flat[row * partial.stride(0) + j % partial.shape[-1]]) for j in range(int(counts[row, 0, 0]))}


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_flex_blocks_are_the_pages_each_row_sees(page_size):
    """On the CPU FlexAttention applies only the mask function; its CUDA kernel reads only the
    listed blocks, as it indexes them, and skips the mask on full ones. So: full blocks are
    exactly the pages a row's query sees whole, and full and partial ones together every page it
    sees any key of."""
    rows, length = 3, 40
    k = v = torch.zeros(rows, length, 1, 4)
    order = [(r, end) for end in range(page_size, length + page_size, page_size) for r in (1, 2, 0)]
    paged = paged_copy(k, v, page_size, order)
    q_pos = torch.tensor([[39], [16], [0]])
    mask = paged.block_mask(q_pos)
    table = paged.page_table
    for row in range(rows):
        key_pos = table.first[:, None] + torch.arange(page_size)
        seen = ((table.owner == row)[:, None] & (key_pos <= q_pos[row, 0])).sum(1)
        listed = read_by_cuda_decoding(mask.full_kv_indices, mask.full_kv_num_blocks, mask.kv_indices, row)
        partial = read_by_cuda_decoding(mask.kv_indices, mask.kv_num_blocks, mask.kv_indices, row)
        assert listed == set((seen == page_size).nonzero()[:, 0].tolist())
        assert listed | partial == set((seen > 0).nonzero()[:, 0].tolist())


def test_paged_attention_in_bfloat16_is_close_to_float64():
    rows, length, kv_heads, heads, dim = 4, 300, 2, 8, 64
    k, v = (torch.randn(rows, length, kv_heads, dim, dtype=torch.float64) for _ in "kv")
    q = torch.randn(rows, 1, heads, dim, dtype=torch.float64)
    q_pos = torch.tensor([[299], [150], [31], [0]])
    order = [(r, length) for r in range(rows)]
    expected = KVRows(k, v, torch.arange(length)[None]).attend(q, q_pos)
    half = paged_copy(k.bfloat16(), v.bfloat16(), 256, order).attend(q.bfloat16(), q_pos)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), expected, rtol=2e-2, atol=2e-2)


GENERATIONS = [(p, "torch") for p in YOCO] + [(p, "flex") for p in YOCO if p.stem in ("yoco-u", "upper-loop-no-shared-kv")]


@pytest.mark.parametrize("path, kernel", GENERATIONS, ids=[f"{p.stem}-{k}" for p, k in GENERATIONS])
@torch.no_grad()
def test_paged_generation_equals_rows(path, kernel):
    """Ragged prompts, prefilled in chunks that cross page boundaries, then decoded: the same
    tokens and, in float64, the same logits as the cache with a row per position."""
    spec = archlab.load_spec(path)
    model = archlab.build_model(spec, dtype=torch.float64).eval()
    prompts = [torch.randint(0, spec.vocab_size, (n,)) for n in (37, 21, 37)]
    rows = Engine(model, prefill_chunk=7).generate(prompts, 6, keep_logits=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        paged = Engine(model, prefill_chunk=7, page_size=8, page_kernel=kernel).generate(prompts, 6, keep_logits=True)
    assert paged.tokens == rows.tokens
    for got, expected in zip(paged.logits, rows.logits):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    table = paged.cache.page_table
    assert int(table.handed) == table.pages == 2 * 6 + 4  # 43, 27 and 43 positions in pages of 8
    assert sorted(table.owner.tolist()) == [-1] + [0] * 6 + [1] * 4 + [2] * 6  # the spare page is nobody's


@torch.no_grad()
def test_a_long_row_among_short_ones_combines_its_pages_over_several_gathers():
    """A decoding step combines each row's pages a few table columns at a time (as many as the
    pool has pages per row): one long prompt among short ones in a pool of just the pages they
    need spreads the long row over several gathers, whose partial results must share one running
    maximum. The same logits, in float64, as the cache with a row per position."""
    spec = archlab.load_spec(TINY[0].parent / "yoco-u.yaml")
    model = archlab.build_model(spec, dtype=torch.float64).eval()
    prompts = [torch.randint(0, spec.vocab_size, (n,)) for n in (37, 3, 3, 3)]
    rows = Engine(model).generate(prompts, 4, keep_logits=True)
    paged = Engine(model, page_size=4).generate(prompts, 4, keep_logits=True)
    table = paged.cache.page_table
    assert table.width > ceil_div(table.pages, len(prompts))  # 11 columns, gathered 5 at a time
    assert paged.tokens == rows.tokens
    torch.testing.assert_close(torch.stack(paged.logits), torch.stack(rows.logits), rtol=1e-12, atol=1e-12)


@torch.no_grad()
def test_parscale_streams_each_get_their_pages():
    """YOCO with two ParScale streams: a row, and pages, per (sequence, stream)."""
    path = TINY[0].parent / "yoco-u.yaml"
    spec = archlab.load_spec(path, ["parscale.streams=2", "parscale.prefix_len=4"])
    model = archlab.build_model(spec, dtype=torch.float64).eval()
    prompts = [torch.randint(0, spec.vocab_size, (n,)) for n in (37, 21)]
    rows = Engine(model, prefill_chunk=7).generate(prompts, 4, keep_logits=True)
    paged = Engine(model, prefill_chunk=7, page_size=8).generate(prompts, 4, keep_logits=True)
    assert paged.tokens == rows.tokens
    torch.testing.assert_close(torch.stack(paged.logits), torch.stack(rows.logits), rtol=1e-12, atol=1e-12)
    assert int(paged.cache.page_table.handed) == 2 * (6 + 4)  # 41 and 25 positions, each stream its own


@torch.no_grad()
def test_a_ragged_batch_holds_only_its_pages():
    """One long prompt among short ones: rows per position hold the longest for every sequence."""
    spec = archlab.load_spec(TINY[0].parent / "yoco-u.yaml")
    model = archlab.build_model(spec).eval()
    prompts = [torch.randint(0, spec.vocab_size, (n,)) for n in (2000, 100, 100, 100)]
    sizes = {}
    for page_size in (None, 256):
        gen = Engine(model, page_size=page_size).generate(prompts, 8)
        sizes[page_size] = gen.cache.bytes_per_sequence().global_
    per_position = 2 * 2 * 16 * 4  # K and V, 2 heads of 16, float32
    assert sizes[None] == 2008 * per_position
    assert sizes[256] == (8 + 3 * 1 + 1) * 256 * per_position // 4
    assert sizes[256] / sizes[None] < 0.4


@torch.no_grad()
def test_running_out_of_pages_is_named_and_keeps_what_was_written():
    spec = archlab.load_spec(TINY[0].parent / "yoco.yaml")
    engine = Engine(archlab.build_model(spec).eval(), page_size=16)
    prompts = [torch.randint(0, spec.vocab_size, (40,)) for _ in range(2)]
    enough, short = engine.new_cache(2, 48), engine.new_cache(2, 48, pages=4)  # the two prompts need 3 pages each
    with pytest.raises(CacheFull, match=r"the prompts need 6 K,V pages of 16 positions; the cache has 4: make it with pages=6"):
        engine.prefill(prompts, short)  # said before anything runs
    assert int(short.page_table.handed) == 0
    for cache in (enough, short):  # fed by hand, the short pool runs out on the way
        for row, prompt in enumerate(prompts):
            engine.feed(prompt[None], torch.tensor([0]), cache.take(torch.tensor([row])), full=False)
    enough.check()
    with pytest.raises(CacheFull, match=r"4 K,V pages of 16 positions ran out: its sequences needed 6 by then\. .*pages=6"):
        short.check()
    (pool,) = short.global_kv.values()
    (reference,) = enough.global_kv.values()
    for page in range(4):  # the pages handed out hold what they were given; the rest went to the spare
        row, first = int(short.page_table.owner[page]), int(short.page_table.first[page])
        same = enough.page_table.table[row, first // 16]
        torch.testing.assert_close(pool["k"][:, page], reference["k"][:, same], rtol=0, atol=0)
        torch.testing.assert_close(pool["v"][:, page], reference["v"][:, same], rtol=0, atol=0)


@torch.no_grad()
def test_a_cache_that_ran_out_is_refused_when_used_again():
    """Its table sends some positions to the spare page for good, and counts pages it never got:
    short prompts were told they needed 8 of 6 pages."""
    spec = archlab.load_spec(TINY[0].parent / "yoco.yaml")
    engine = Engine(archlab.build_model(spec).eval(), page_size=8)
    cache = engine.new_cache(2, 64, pages=6)
    engine.prefill([torch.randint(0, spec.vocab_size, (16,)) for _ in range(2)], cache)
    with pytest.raises(CacheFull, match="6 K,V pages of 8 positions ran out"):
        for position in range(16, 36):
            engine.decode(torch.zeros(2, 1, dtype=torch.long), torch.tensor([position] * 2), cache)
            cache.check()
    with pytest.raises(CacheFull, match=r"ran out of room in an earlier use .* make a new one"):
        list(engine.stream([torch.randint(0, spec.vocab_size, (5,)) for _ in range(2)], 3, cache=cache))


@torch.no_grad()
def test_a_cache_used_to_its_last_page_serves_again_within_the_pages_its_rows_hold():
    """Pages stay with their rows for the cache's life. A pool used to its last page has not run
    out: prompts within each row's pages decode in it as in a fresh cache. Prompts that move the
    long one to the other row need 3 + 3 pages, the rows keeping what they hold, not 1 + 3: said
    before anything runs, with the pages they need, rather than running out on the way."""
    spec = archlab.load_spec(TINY[0].parent / "yoco.yaml")
    engine = Engine(archlab.build_model(spec).eval(), page_size=8)
    long, short = (torch.randint(0, spec.vocab_size, (n,)) for n in (20, 4))  # with 4 new tokens: 3 pages and 1
    cache = engine.new_cache(2, 32, pages=4)
    list(engine.stream([long, short], 4, cache=cache))
    assert int(cache.page_table.handed) == 4 and cache.page_table.held.tolist() == [3, 1]
    again = [torch.randint(0, spec.vocab_size, (n,)) for n in (18, 3)]
    tokens = lambda cache: torch.stack([t for t, _, _ in engine.stream(again, 4, cache=cache)])  # noqa: E731
    assert torch.equal(tokens(cache), tokens(engine.new_cache(2, 32, pages=4)))
    with pytest.raises(CacheFull, match=r"the prompts and their 4 new tokens each need 6 K,V pages of 8 positions; the cache has 4"):
        engine.stream([short, long], 4, cache=cache)
    assert int(cache.page_table.handed) == 4


def test_a_pool_that_runs_out_at_the_last_token_is_named(monkeypatch):
    """The last token is only written into the cache, not decoded; past the pool, it went to the
    spare page with nothing said. The check at the call stops this first; without it, the check
    after that last write still does."""
    spec = archlab.load_spec(TINY[0].parent / "yoco.yaml")
    engine = Engine(archlab.build_model(spec).eval(), page_size=4)
    prompt = torch.randint(0, spec.vocab_size, (4,))  # one page; the new token opens a second
    with pytest.raises(CacheFull, match=r"need 2 K,V pages of 4 positions; the cache has 1: make it with pages=2"):
        engine.stream([prompt], 1, cache=engine.new_cache(1, 20, pages=1))
    monkeypatch.setattr(engine, "check_cache", lambda *args: None)
    with pytest.raises(CacheFull, match=r"1 K,V pages of 4 positions ran out: its sequences needed 2 by then"):
        list(engine.stream([prompt], 1, cache=engine.new_cache(1, 20, pages=1)))


@pytest.mark.parametrize("kernel", ["torch", "flex"])
@pytest.mark.parametrize("position", [20, 40, 48, 100])
@torch.no_grad()
def test_decoding_past_the_capacity_is_named(position, kernel):
    """Capacity 20 in pages of 16: 20 is in the last page's slack, 40 the dump column's, 48 and
    100 past the table, whose writes and reads go to the spare page rather than out of bounds."""
    spec = archlab.load_spec(TINY[0].parent / "yoco.yaml")
    engine = Engine(archlab.build_model(spec).eval(), page_size=16, page_kernel=kernel)
    cache = engine.new_cache(1, 20)
    engine.prefill([torch.randint(0, spec.vocab_size, (20,))], cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        engine.decode(torch.tensor([[1]]), torch.tensor([position]), cache)
    with pytest.raises(CacheFull, match="a sequence went past the cache's capacity of 20 positions"):
        cache.check()


@pytest.mark.parametrize("full", [False, True], ids=["prefill-steps", "whole-model"])
@torch.no_grad()
def test_feeding_a_prompt_far_past_the_capacity_is_named(full):
    """A block of 60 tokens into capacity 20: the prefill steps write past the table, and the
    whole model's cross-decoder reads its pages for a block of queries too."""
    spec = archlab.load_spec(TINY[0].parent / "yoco.yaml")
    engine = Engine(archlab.build_model(spec).eval(), page_size=16)
    cache = engine.new_cache(1, 20)
    engine.feed(torch.randint(0, spec.vocab_size, (1, 60)), torch.tensor([0]), cache, full=full)
    with pytest.raises(CacheFull, match="a sequence went past the cache's capacity of 20 positions"):
        cache.check()
    assert set(cache.page_table.table[0].tolist()) == {0, 1, cache.page_table.spare}  # two pages of the 20, the rest spare


def test_paging_asks_for_a_positive_page_size_and_a_known_kernel():
    model = archlab.build_model(archlab.load_spec(TINY[0].parent / "yoco.yaml"))
    with pytest.raises(ValueError, match="page_size must be a whole number >= 1, got 0"):
        Engine(model, page_size=0)
    with pytest.raises(ValueError, match="page_kernel must be one of torch, flex, got 'triton'"):
        Engine(model, page_size=256, page_kernel="triton")


def test_the_paged_benchmarks_paper_scale_table_is_sized_on_the_meta_device(monkeypatch):
    """The README's figure (8.25 GiB in pages of 256 against 16.0 GiB in rows, batch 32 of 8K..256K);
    an engine on the meta device was refused for a while, which only the benchmark's run showed."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from paged_kv import paper_scale

    table = paper_scale()
    assert table[2].startswith("| pages of 256 | 8.3 |") and table[3].startswith("| rows for the longest | 16.0 |"), table
