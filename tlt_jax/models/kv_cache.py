"""The paged KV cache a cached forward (models.transformer) reads and writes.

KV cache (paged): k, v, each a tuple of L per-layer page pools [P, page, K, H]; `table` [B, R],
row b's page ids (slot s of row b lives at page table[b, s // page], offset s % page; an
unallocated entry is NO_PAGE: a write there is dropped, a read clipped and masked); `lengths`
[B], the committed tokens of each row. A row holds R * page slots (`max_len`). Pages are
owned by rows only through the table, which the host-side allocator (rollout/pages.py) fills:
a replica's KV memory follows the tokens its rows hold, not max_batch x max_len, and a
compaction or refill moves table rows, never k/v. A forward over T new tokens writes their
keys/values at slots lengths[b] .. lengths[b] + T - 1 and attends to the committed prefix
plus the new tokens allowed by `attn_mask` (causal by default; a tree mask when verifying
draft trees). It does NOT advance `lengths`: the caller commits what it accepts (plain
decode: all T; speculative verify: the accepted path), and slots past `lengths` are masked
and later overwritten. `init_cache` gives every row its own contiguous pages (a dense cache's
equivalent).

Attention window `kv_len` (static): attention reads only slots [0, kv_len) of each row (the
pages of the table's first ceil(kv_len / page) columns, gathered), while writes go wherever
the table says. The rollout engine picks it per chunk from the longest live row
(`kv_bucket`), so the bytes a step reads follow the rows' live lengths, not the cache's
capacity: at 4096 allocated new tokens, reading all S slots made a 189M model's decode of
20-40 token responses 6.1x slower per token than at 256 on CPU (scripts/bench_kv_len.py).
Slots past a row's length are masked either way, so the window changes no result as long as
it holds every slot a query may see (lengths + T).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig


# A table entry without a page: scatters drop it (out of range), gathers clip it (the slots
# it stands for are past the row's length: masked).
NO_PAGE = 1 << 30


def pages_for(slots: int, page_size: int) -> int:
  """Pages that hold `slots` cache slots: the one slots-to-pages rule (page tables, the
  engine's row and pool sizes, admission, the memory plan)."""
  return -(-max(slots, 0) // page_size)


@flax.struct.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # L x [P, page, K, H] page pools
  v: tuple[jax.Array, ...]  # L x [P, page, K, H]
  table: jax.Array  # [B, R] int32 page ids (NO_PAGE: none)
  lengths: jax.Array  # [B] int32, committed tokens per sequence

  @property
  def page_size(self) -> int:
    return self.k[0].shape[1]

  @property
  def num_pages(self) -> int:
    return self.k[0].shape[0]

  @property
  def max_len(self) -> int:
    """Slots a row can hold."""
    return self.table.shape[1] * self.page_size

  @property
  def batch_size(self) -> int:
    return self.table.shape[0]

  @property
  def num_layers(self) -> int:
    return len(self.k)

  def rows(self, i: int, which: str = "k") -> jax.Array:
    """Layer i's k (or v) as the dense [B, max_len, K, H] it stands for (tests, debugging)."""
    return gather_window(getattr(self, which)[i], self.table, self.max_len)


class CacheAddr(NamedTuple):
  """Where a forward writes and reads, computed once for all layers (`cache_addr`)."""
  page: jax.Array  # [B, T] page of each new token's slot (NO_PAGE: dropped)
  offset: jax.Array  # [B, T] its offset in the page
  window: jax.Array  # [B, ceil(W / page)] pages of the attention window of W slots


def slot_addr(cache: KVCache, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
  """slots [B, T] -> (page, offset) [B, T]; slots outside [0, max_len) -> NO_PAGE."""
  ps = cache.page_size
  col = jnp.clip(slots // ps, 0, cache.table.shape[1] - 1)
  page = jnp.take_along_axis(cache.table, col, axis=1)
  page = jnp.where((slots >= 0) & (slots < cache.max_len), page, NO_PAGE)
  return page, slots % ps


def cache_addr(cache: KVCache, slots: jax.Array, width: int) -> CacheAddr:
  page, offset = slot_addr(cache, slots)
  return CacheAddr(page, offset, cache.table[:, :pages_for(width, cache.page_size)])


def gather_window(pool: jax.Array, window: jax.Array, width: int) -> jax.Array:
  """pool [P, page, K, H], window [B, n] page ids -> [B, width, K, H] (width <= n * page)."""
  b, n = window.shape
  x = jnp.take(pool, window, axis=0, mode="clip")  # [B, n, page, K, H]
  return x.reshape((b, n * pool.shape[1]) + pool.shape[2:])[:, :width]


def write_kv(pool: jax.Array, addr: CacheAddr, x: jax.Array) -> jax.Array:
  """x [B, T, K, H] into `pool` at the new tokens' slots (in place under donation)."""
  return pool.at[addr.page, addr.offset].set(x.astype(pool.dtype), mode="drop")


def move_slots(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
  """Every layer's k/v at slots src [B, T] copied to slots dst [B, T] of the same rows (a
  tree verification commits its accepted path so)."""
  sp, so = slot_addr(cache, src)
  dp, do = slot_addr(cache, dst)
  sp = jnp.minimum(sp, cache.num_pages - 1)
  move = lambda p: p.at[dp, do].set(p[sp, so], mode="drop")
  return cache.replace(k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)))


DEFAULT_PAGE = 16


def init_pools(cfg: ModelConfig, num_pages: int, page_size: int = DEFAULT_PAGE, dtype=None,
               row_pages: int = 1) -> KVCache:
  """Zeroed page pools and no rows (table [0, row_pages]): the rollout engine's KV memory,
  whose pages its allocator hands to rows (rollout/pages.py; rollout/decode.py's `set_tables`
  gives a state their tables)."""
  shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim_)
  dtype = dtype or cfg.compute_dtype
  zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
  return KVCache(k=zeros(), v=zeros(), table=jnp.zeros((0, row_pages), jnp.int32),
                 lengths=jnp.zeros((0,), jnp.int32))


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None,
               page_size: int = DEFAULT_PAGE) -> KVCache:
  """A cache of `batch_size` empty rows of at least `max_len` slots, each with its own
  contiguous pages (what a dense [B, S] cache would hold)."""
  r = pages_for(max_len, page_size)
  pools = init_pools(cfg, batch_size * r, page_size, dtype, r)
  table = jnp.arange(batch_size * r, dtype=jnp.int32).reshape(batch_size, r)
  return pools.replace(table=table, lengths=jnp.zeros((batch_size,), jnp.int32))
