"""The CUDA caching allocator's blocks, pools and segments as c10 keeps them: `CachingAllocator`, a pure state
machine (no CUDA call) that `cuda_caching.replay` drives, and the sizes it gives (`round_size`, `allocation_size`).

The rules, read from c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch, the stored copy at commit 001074d2; the
function names are c10's) with the constants of torch 2.14.1's installed c10/core/AllocatorConfig.h:
- every request rounds up to 512 B (`kMinBlockSize`), or with `roundup_power2_divisions` to the next of n equal
  steps between two powers of two (`round_size`, `roundup_power2_next_division`);
- rounded sizes up to 1 MiB (`kSmallSize`) use the small pool, larger ones the large pool; pools are per stream;
- a request takes the smallest cached free block of its pool and stream that fits, the lowest address among
  equal sizes (`get_free_block`: a `std::set` ordered by stream, size, address); under `max_split_size` a request
  below it never takes a block at or above it, and one at or above it only a block less than
  `max_non_split_rounding_size` larger;
- without one it cudaMallocs a segment (`get_allocation_size`): 2 MiB (`kSmallBuffer`) for the small pool,
  `large_segment_size` (20 MiB, `kLargeBuffer`) below 10 MiB (`kMinLargeAlloc`), else the size rounded up to
  2 MiB (`kRoundLarge`);
- the block found is split when the small pool's remainder is at least 512 B, or the large pool's more than 1 MiB
  for a request below `max_split_size` (`should_split`); with expandable segments at least 512 B in either;
- a freed block merges with the free neighbours of its segment (`free_block`, `try_merge_blocks`);
- when cudaMalloc fails (reserved + segment > `capacity`, or > `allowed`: a memory fraction of the device's
  total) it frees cached oversize blocks (`release_available_cached_blocks`, under `max_split_size` only),
  retries, then frees every cached unsplit segment (`release_cached_blocks`) and retries once more
  (`num_alloc_retries`); after that the request fails;
- `garbage_collection_threshold` (under a memory fraction only, as in c10): before a cudaMalloc, once reserved
  exceeds the threshold of the allowed bytes, cached unsplit large blocks at least as old as their average age
  (in free-block searches of the large pool since they were cached) are freed until reserved is under it
  (`garbage_collect_cached_blocks`);
- `expandable_segments`: one segment per pool and stream that grows by mapping pages (2 MiB small, the large
  segment size large) at the lowest address that fits (`find_expandable_block`, `map_block`; a mapping that
  fails maps nothing, as cuMemCreate's rollback); before a retry the whole free pages are unmapped
  (`unmap_block`) and a segment with none mapped is released.

Example:
    >>> a = CachingAllocator()
    >>> block = a.malloc(3 << 20, stream=0)           # a 20 MiB segment, split: 3 MiB handed out
    >>> a.reserved >> 20, a.allocated >> 20
    (20, 3)
    >>> a.free(block); a.allocated
    0
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from memfit.device.cuda_alloc_conf import AllocatorConfig

__all__ = ["CachingAllocator", "Segment", "allocation_size", "round_size"]

K_MIN_BLOCK = 512                  # kMinBlockSize: every block a multiple of it
K_SMALL_SIZE = 1 << 20             # kSmallSize: the largest small-pool request
K_SMALL_BUFFER = 2 << 20           # kSmallBuffer: a small-pool segment
K_MIN_LARGE_ALLOC = 10 << 20       # kMinLargeAlloc: requests below it share large_segment_size segments
K_ROUND_LARGE = 2 << 20            # kRoundLarge: larger segments round up to it
_NEVER = float("inf")              # max_split_size unset: SIZE_MAX
_ADDR = (1 << 64) - 1              # a cached block's key is size << 64 | address
DEFAULTS = AllocatorConfig()       # c10's settings when PYTORCH_CUDA_ALLOC_CONF is not set


def round_size(nbytes: int, config: AllocatorConfig = DEFAULTS) -> int:
    """The block size c10 gives a request of `nbytes` (`DeviceCachingAllocator::round_size`).

    Example:
        >>> round_size(1), round_size(513), round_size(1200 << 10, AllocatorConfig.parse("roundup_power2_divisions:4"))
        (512, 1024, 1310720)
    """
    if nbytes < K_MIN_BLOCK:
        return K_MIN_BLOCK
    divisions = config.divisions(nbytes)
    if divisions > 1 and nbytes > K_MIN_BLOCK * divisions:
        if nbytes & (nbytes - 1) == 0:
            return nbytes
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)            # power2_floor >> log2(divisions)
        if step == 0:
            return floor << 1
        rounded = nbytes & ~(step - 1)
        return nbytes if rounded == nbytes else rounded + step
    return -(-nbytes // K_MIN_BLOCK) * K_MIN_BLOCK


def allocation_size(size: int, config: AllocatorConfig = DEFAULTS) -> int:
    """The segment c10 cudaMallocs for a block of `size` rounded bytes (`get_allocation_size`).

    Example:
        >>> [allocation_size(s) >> 20 for s in (512, 2 << 20, 11 << 20)]
        [2, 20, 12]
    """
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return config.large_segment_size
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(frozen=True)
class Segment:
    """One segment the allocator holds: `size` bytes reserved (for an expandable segment, its mapped pages)."""
    size: int
    pool: str           # 'small' or 'large'
    stream: object
    expandable: bool


class _Block:
    __slots__ = ("addr", "size", "stream", "small", "pool", "allocated", "mapped", "prev", "next", "seg", "gc_base",
                 "orig")

    def __init__(self, addr, size, stream, small, seg, mapped=True):
        self.addr, self.size, self.stream, self.small, self.seg, self.mapped = addr, size, stream, small, seg, mapped
        self.pool = (small, stream)
        self.allocated = False
        self.prev = self.next = None
        self.gc_base = 0
        self.orig = 0


class _Expandable:
    """An expandable segment: `pages` of `page` bytes of address space from `base`, `mapped` of them backed."""
    __slots__ = ("base", "page", "pages", "mapped")

    def __init__(self, base, page, pages):
        self.base, self.page, self.pages, self.mapped = base, page, pages, 0


class CachingAllocator:
    """c10's DeviceCachingAllocator for one device, replayed: `malloc(nbytes, stream)` gives a block or None when
    the allocator would raise out-of-memory, `free(block)` caches it; `reserved` and `allocated` are the bytes of
    torch.cuda.memory_reserved / memory_allocated.

    Args:
        config: the allocator's settings (c10's defaults unless given).
        capacity: the bytes cudaMalloc can reserve in all; None: unlimited.
        device_total: the device's total memory: a memory fraction is of it (c10's allowed_memory_maximum), and
            an expandable segment reserves address space for 9/8 of it; None: `capacity`, else 64 TiB.
        memory_fraction: as torch.cuda.set_per_process_memory_fraction (else the config's
            per_process_memory_fraction, else none).
    """

    def __init__(self, config: AllocatorConfig = DEFAULTS, capacity: int | None = None,
                 device_total: int | None = None, memory_fraction: float | None = None):
        device_total = capacity if device_total is None else device_total
        fraction = memory_fraction if memory_fraction is not None else config.per_process_memory_fraction
        if fraction is not None and device_total is None:
            raise ValueError("a memory fraction is a fraction of the device's memory: give device_total (or capacity)")
        if not 0.0 <= (fraction or 0.0) <= 1.0:
            raise ValueError(f"memory_fraction must be in [0, 1], found {fraction}")
        self.config = config
        self.expandable = config.expandable_segments
        self.power2 = any(d > 1 for d in config.roundup_power2_divisions)   # else 512-byte rounding only
        self.max_split = _NEVER if config.max_split_size is None else config.max_split_size
        self.capacity = capacity
        self.device_total = device_total
        self.allowed = None if fraction is None else int(fraction * device_total)
        self.gc = self.allowed is not None and config.garbage_collection_threshold > 0
        self.cached: dict = {}          # (small, stream) -> sorted [size << 64 | addr] of cached mapped free blocks
        self.unmapped: dict = {}      # (small, stream) -> sorted [addr] of unmapped expandable blocks
        self.blocks: dict = {}        # addr -> _Block of every free block, mapped or not
        self.searches = [0, 0]        # get_free_blocks_call_count of the large [0] and small [1] pools
        self.segments: dict = {}      # segment id -> Segment of the live non-expandable segments
        self.expandables: dict = {}   # (small, stream) -> [_Expandable]
        self.next_addr = 0
        self.reserved = self.allocated = 0
        self.mallocs = self.frees = self.retries = 0

    # ---- the free-block sets: c10's BlockPool::blocks and ::unmapped
    def _insert(self, b: _Block) -> None:
        self.blocks[b.addr] = b
        if b.mapped:
            b.gc_base = self.searches[b.small]
            insort(self.cached.setdefault(b.pool, []), b.size << 64 | b.addr)   # one int: faster than a tuple
        else:
            insort(self.unmapped.setdefault(b.pool, []), b.addr)

    def _erase(self, b: _Block) -> None:
        del self.blocks[b.addr]
        if b.mapped:
            keys = self.cached[b.pool]
            del keys[bisect_left(keys, b.size << 64 | b.addr)]
        else:
            addrs = self.unmapped[b.pool]
            del addrs[bisect_left(addrs, b.addr)]

    def _merge(self, dst: _Block, src: _Block | None) -> None:
        """try_merge_blocks: `src`, a free neighbour in the same state, joins `dst`."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        self._erase(src)
        if dst.prev is src:
            dst.addr, dst.prev = src.addr, src.prev
            if dst.prev:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next:
                dst.next.prev = dst
        dst.size += src.size

    # ---- malloc
    def malloc(self, nbytes: int, stream) -> _Block | None:
        size = round_size(nbytes, self.config) if self.power2 or nbytes < K_MIN_BLOCK else -(-nbytes // 512) * 512
        small = size <= K_SMALL_SIZE
        block = self._get_free_block(size, small, stream)
        if block is None:
            seg = allocation_size(size, self.config)
            if self.gc:
                self._garbage_collect()
            block = self._alloc_block(size, seg, small, stream)
            if block is None and self._release_available(size, small, stream):
                block = self._alloc_block(size, seg, small, stream)
            if block is None:
                self._release_cached()
                self.retries += 1
                block = self._alloc_block(size, seg, small, stream)
            if block is None:
                return None
        remaining = block.size - size
        if small or self.expandable:
            split = remaining >= K_MIN_BLOCK
        else:
            split = size < self.max_split and remaining > K_SMALL_SIZE
        if split:
            rest = _Block(block.addr + size, remaining, stream, small, block.seg)
            rest.prev, rest.next = block, block.next
            if block.next:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert(rest)
        block.allocated = True
        block.orig = nbytes
        self.allocated += block.size
        return block

    def _get_free_block(self, size, small, stream) -> _Block | None:
        if self.gc:
            self.searches[small] += 1
        keys = self.cached.get((small, stream))
        if not keys:
            return None
        i = bisect_left(keys, size << 64)
        if i == len(keys):
            return None
        b = self.blocks[keys[i] & _ADDR]
        if self.expandable:
            # the block at a segment's mapped end can grow: best fit counts what it can grow to
            def grows(x):
                return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)
            while isinstance(b.seg, _Expandable) and i + 1 < len(keys):
                nxt = self.blocks[keys[i + 1] & _ADDR]
                if grows(nxt) >= grows(b):
                    break
                i, b = i + 1, nxt
        if size < self.max_split <= b.size:
            return None                            # no oversize block for a request below max_split_size
        if size >= self.max_split and b.size >= size + self.config.max_non_split_rounding_size:
            return None
        self._erase(b)
        return b

    def _alloc_block(self, size, seg, small, stream) -> _Block | None:
        if self.allowed is not None and self.reserved + seg > self.allowed:
            return None
        if self.config.expandable_segments:
            return self._alloc_expandable(size, small, stream)
        if self.capacity is not None and self.reserved + seg > self.capacity:
            return None
        b = _Block(self.next_addr, seg, stream, small, self.next_addr)
        self.segments[self.next_addr] = Segment(seg, "small" if small else "large", stream, False)
        self.next_addr += seg
        self.reserved += seg
        self.mallocs += 1
        return b

    def _release_block(self, b: _Block) -> None:
        self._erase(b)
        del self.segments[b.seg]
        self.reserved -= b.size
        self.frees += 1

    def _release_available(self, size, small, stream) -> bool:
        """release_available_cached_blocks: under max_split_size, free one cached oversize block that fits, else
        the largest ones until their bytes reach the request."""
        if self.max_split is _NEVER or self.config.expandable_segments:
            return False            # c10 asserts on an expandable block here (release_block); the replay skips it
        keys = self.cached.get((small, stream)) or []
        want = max(size, self.max_split)
        i = bisect_left(keys, want << 64)
        if i < len(keys):
            b = self.blocks[keys[i] & _ADDR]
            if b.prev is not None or b.next is not None:
                return False        # never seen: a block of max_split_size or more is a whole segment
            self._release_block(b)
            return True
        released = 0
        for key in reversed(list(keys)):
            b = self.blocks[key & _ADDR]
            if released >= want or b.size < self.max_split or b.prev is not None or b.next is not None:
                break
            released += b.size
            self._release_block(b)
        return released >= want

    def _release_cached(self) -> None:
        """release_cached_blocks: every cached whole segment freed, every free page of an expandable one unmapped."""
        for b in [b for b in self.blocks.values() if b.mapped]:
            if isinstance(b.seg, _Expandable):
                self._unmap(b)
            elif b.prev is None and b.next is None:
                self._release_block(b)

    def _garbage_collect(self) -> None:
        threshold = int(self.config.garbage_collection_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        candidates = [b for b in self.blocks.values() if b.mapped and not b.small and b.prev is None
                      and b.next is None and not isinstance(b.seg, _Expandable)]
        age = {b.addr: self.searches[0] - b.gc_base for b in candidates}
        total, count = sum(age.values()), len(candidates)
        freed = True
        while reclaimed < target and freed and count:
            average, freed = total / count, False
            for b in sorted(candidates, key=lambda x: (x.stream, x.size, x.addr)):
                if b.addr in self.blocks and age[b.addr] >= average:
                    freed, reclaimed, total, count = True, reclaimed + b.size, total - age[b.addr], count - 1
                    self._release_block(b)
            candidates = [b for b in candidates if b.addr in self.blocks]

    # ---- expandable segments
    def _alloc_expandable(self, size, small, stream) -> _Block | None:
        c = self._find_expandable(size, small, stream)
        if not c.mapped:
            c = self._map(c, min(c.size, size))
            if c is None:
                return None
        while c.size < size:
            c = self._map(c.next, min(size - c.size, c.next.size))
            if c is None:
                return None
        self._erase(c)
        return c

    def _find_expandable(self, size, small, stream) -> _Block:
        def allocatable(b):
            return b is not None and not b.allocated

        for addr in self.unmapped.get((small, stream), ()):
            c = self.blocks[addr]
            if allocatable(c.prev):
                c = c.prev
            room, b = 0, c
            while room < size and allocatable(b):
                room, b = room + b.size, b.next
            if room >= size:
                return c
        page = K_SMALL_BUFFER if small else self.config.large_segment_size
        total = self.device_total if self.device_total is not None else 1 << 46
        pages = -(-(total + total // 8) // page)       # c10: address space for 9/8 of the device's memory
        seg = _Expandable(self.next_addr, page, pages)
        self.expandables.setdefault((small, stream), []).append(seg)
        self.next_addr += pages * page
        c = _Block(seg.base, pages * page, stream, small, seg, mapped=False)
        self._insert(c)
        return c

    def _map(self, b: _Block, size: int) -> _Block | None:
        """map_block: back the first pages of unmapped `b` covering `size` bytes; all or nothing, as cuMemCreate."""
        seg = b.seg
        first = (b.addr - seg.base) // seg.page
        last = -(-(b.addr + size - seg.base) // seg.page)
        nbytes = (last - first) * seg.page
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return None
        self._erase(b)
        if nbytes < b.size:
            rest = _Block(b.addr + nbytes, b.size - nbytes, b.stream, b.small, seg, mapped=False)
            rest.prev, rest.next = b, b.next
            if b.next:
                b.next.prev = rest
            b.next = rest
            b.size = nbytes
            self._insert(rest)
        b.mapped = True
        self._merge(b, b.prev)
        self._merge(b, b.next)
        self._insert(b)
        seg.mapped += nbytes
        self.reserved += nbytes
        self.mallocs += 1
        return b

    def _unmap(self, b: _Block) -> None:
        """unmap_block: give back the whole pages inside free `b`; the partial pages at its ends stay cached."""
        seg = b.seg
        first = -(-(b.addr - seg.base) // seg.page)
        last = (b.addr + b.size - seg.base) // seg.page
        if first >= last:
            return
        self._erase(b)
        start, nbytes = seg.base + first * seg.page, (last - first) * seg.page
        for lo, hi, before in ((b.addr, start, True), (start + nbytes, b.addr + b.size, False)):
            if hi > lo:
                part = _Block(lo, hi - lo, b.stream, b.small, seg)
                if before:
                    part.prev, part.next = b.prev, b
                    if b.prev:
                        b.prev.next = part
                    b.prev = part
                else:
                    part.prev, part.next = b, b.next
                    if b.next:
                        b.next.prev = part
                    b.next = part
                self._insert(part)
        b.addr, b.size, b.mapped = start, nbytes, False
        self._merge(b, b.prev)
        self._merge(b, b.next)
        self._insert(b)
        seg.mapped -= nbytes
        self.reserved -= nbytes
        self.frees += 1
        if b.prev is None and b.next is None:          # the whole segment unmapped: its address space released
            self._erase(b)
            self.expandables[(b.small, b.stream)].remove(seg)

    # ---- free
    def free(self, b: _Block) -> None:
        b.allocated = False
        self.allocated -= b.size
        if b.prev is not None and not b.prev.allocated:
            self._merge(b, b.prev)
        if b.next is not None and not b.next.allocated:
            self._merge(b, b.next)
        self._insert(b)

    def snapshot(self) -> tuple[tuple[Segment, ...], int]:
        segments = list(self.segments.values())
        for (small, stream), segs in self.expandables.items():
            segments += [Segment(s.mapped, "small" if small else "large", stream, True) for s in segs if s.mapped]
        largest = max((keys[-1] >> 64 for keys in self.cached.values() if keys), default=0)
        return tuple(segments), largest
