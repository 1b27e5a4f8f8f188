"""A plain-Python model of vLLM's hybrid KV-cache manager (vLLM 0.33, its free order included), one request at a
time, written from the rules rather than from the jitted code: the oracle of the allocator's tests.

It follows the jitted allocator's documented choices where they differ from vLLM: a failed allocation changes
nothing; prefix hits are looked up inside `allocate` for a request that holds no blocks; caching is keyed by the
exact token prefix (no hash collisions) plus group, salt and adapter.
"""

import math

from jax_hybrid_attn.integers import cdiv

FULL, SLIDING_WINDOW, CHUNKED_LOCAL = 0, 1, 2
NULL = 0


class Oracle:
    def __init__(
        self,
        *,
        kinds,
        block_sizes,
        windows,
        chunks,
        num_blocks,
        max_model_len,
        caps,
        enable_caching=True,
        in_window_only=False,
    ):
        self.kinds, self.block_sizes, self.windows, self.chunks = kinds, block_sizes, windows, chunks
        self.num_groups = len(kinds)
        self.num_blocks, self.max_model_len, self.caps = num_blocks, max_model_len, caps
        self.enable_caching, self.in_window_only = enable_caching, in_window_only
        self.alignment = math.lcm(*block_sizes)
        self.free = list(range(1, num_blocks))  # head first
        self.ref = [0] * num_blocks
        self.key_of = [None] * num_blocks
        self.cache: dict = {}  # key -> blocks in insertion order
        self.tokens: dict = {}
        self.extra: dict = {}
        self.blocks: dict = {}  # slot -> per group block list (running requests only)
        self.num_cached: dict = {}
        self.stats = [0, 0, 0]

    # --------------------------------------------------------------------------------------------- pool

    def _key(self, slot, group, index):
        size = self.block_sizes[group]
        return (self.extra[slot], group, tuple(self.tokens[slot][: (index + 1) * size]))

    def _free_blocks(self, ordered):
        head, tail = [], []
        for block in ordered:
            if block == NULL:
                continue
            self.ref[block] -= 1
            assert self.ref[block] >= 0
            if self.ref[block] == 0:
                (tail if self.key_of[block] is not None else head).append(block)
        self.free = head + self.free + tail

    def _take(self, n):
        taken, self.free = self.free[:n], self.free[n:]
        for block in taken:
            key = self.key_of[block]
            if key is not None:
                self.cache[key].remove(block)
                if not self.cache[key]:
                    del self.cache[key]
                self.key_of[block] = None
            self.ref[block] = 1
        return taken

    def _touch(self, blocks):
        for block in blocks:
            if block == NULL:
                continue
            if self.ref[block] == 0:
                self.free.remove(block)
            self.ref[block] += 1

    def _cached_block(self, key):
        blocks = self.cache.get(key)
        return blocks[0] if blocks else None

    # ----------------------------------------------------------------------------------------- managers

    def skipped_tokens(self, group, n):
        kind = self.kinds[group]
        if kind == SLIDING_WINDOW:
            return max(0, n - self.windows[group] + 1)
        if kind == CHUNKED_LOCAL:
            return n // self.chunks[group] * self.chunks[group]
        return 0

    def _find(self, group_ids, max_length, slot):
        g = group_ids[0]
        kind, size = self.kinds[g], self.block_sizes[g]
        align = self.alignment

        def lookup(i):
            found = [self._cached_block(self._key(slot, h, i)) for h in group_ids]
            return None if any(b is None for b in found) else found

        count = max_length // size
        if kind == FULL:
            lists = [[] for _ in group_ids]
            for i in range(count):
                found = lookup(i)
                if found is None:
                    break
                for lst, b in zip(lists, found):
                    lst.append(b)
            while lists[0] and len(lists[0]) * size % align:
                for lst in lists:
                    lst.pop()
            return lists
        if kind == SLIDING_WINDOW:
            need = cdiv(self.windows[g] - 1, size)
            lists = [[NULL] * count for _ in group_ids]
            contiguous, found_run = 0, False
            for i in range(count - 1, -1, -1):
                found = lookup(i)
                if found is not None:
                    if contiguous == 0 and size != align and (i + 1) * size % align:
                        continue
                    for lst, b in zip(lists, found):
                        lst[i] = b
                    contiguous += 1
                    if contiguous >= need:
                        for lst in lists:
                            del lst[i + contiguous :]
                        found_run = True
                        break
                else:
                    contiguous = 0
            if not found_run:
                for lst in lists:
                    del lst[contiguous:]
                while size != align and len(lists[0]) * size % align:
                    for lst in lists:
                        lst.pop()
            return lists
        chunk = self.chunks[g]
        start = max_length // chunk * chunk if max_length else 0
        lists = [[NULL] * (start // size) for _ in group_ids]
        for i in range(start // size, count):
            found = lookup(i)
            if found is None:
                break
            for lst, b in zip(lists, found):
                lst.append(b)
        return lists

    def find_hits(self, slot):
        """vLLM's hybrid coordinator: fixed point over the attention groups (full first)."""
        max_length = len(self.tokens[slot]) - 1
        specs = {}
        for g in range(self.num_groups):
            specs.setdefault(
                (self.kinds[g], self.block_sizes[g], self.windows[g], self.chunks[g]), []
            ).append(g)
        attention_groups = sorted(specs.values(), key=lambda ids: self.kinds[ids[0]] != FULL)
        length = max(max_length, 0)
        result = {}
        while True:
            previous = length
            for ids in attention_groups:
                lists = self._find(ids, length, slot)
                length = len(lists[0]) * self.block_sizes[ids[0]]
                for g, lst in zip(ids, lists):
                    result[g] = lst
            if length == previous:
                break
        return length, [result[g][: length // self.block_sizes[g]] for g in range(self.num_groups)]

    # --------------------------------------------------------------------------------------------- API

    def add_request(self, slot, tokens, extra=(None, 0)):
        assert slot not in self.blocks
        self.tokens[slot] = list(tokens)
        self.extra[slot] = extra

    def append(self, slot, tokens):
        self.tokens[slot].extend(tokens)

    def allocate(self, slot, num_computed, num_new, lookahead=0, must_fit=False):
        """Returns (success, computed tokens after hits, scheduled tokens)."""
        running = slot in self.blocks
        num_tokens = len(self.tokens[slot])
        hit_len, hit_lists = 0, [[] for _ in range(self.num_groups)]
        if not running and self.enable_caching and num_computed == 0 and num_new > 0:
            hit_len, hit_lists = self.find_hits(slot)
            self.stats[0] += 1
            self.stats[1] += num_tokens
            self.stats[2] += hit_len
        computed = num_computed + hit_len
        new = min(num_new, num_tokens - computed) if not running else num_new
        if self.in_window_only:  # the chunk ends where every new token is still read by a later step
            for g in range(self.num_groups):
                if self.kinds[g] == SLIDING_WINDOW:
                    size = self.block_sizes[g]
                    new = min(new, max(1, self.windows[g] - 2 + size - computed % size))
        if num_new <= 0 or new <= 0 or computed + new > self.max_model_len or num_computed < 0:
            return False, computed, 0
        end = min(computed + new + lookahead, self.max_model_len)
        free_before = len(self.free)

        plan = []
        need = 0
        freed_to_zero = 0
        for g in range(self.num_groups):
            size = self.block_sizes[g]
            skipped = self.skipped_tokens(g, computed) // size
            if running:
                blocks = self.blocks[slot][g]
                k = min(skipped, len(blocks))
                freed = [blocks[i] for i in range(k - 1, -1, -1) if blocks[i] != NULL]
                freed_to_zero += sum(1 for b in freed if self.ref[b] == 1)
                base = len(blocks)
                touched = []
            else:
                freed = []
                hits = hit_lists[g]
                touched = [b for i, b in enumerate(hits) if i >= skipped and b != NULL]
                need += sum(1 for b in touched if self.ref[b] == 0)
                base = max(skipped, len(hits))
            new_start = base
            count = max(cdiv(end, size) - new_start, 0)
            need += count
            plan.append((skipped, freed, touched, base, new_start, count))
        if need > free_before + freed_to_zero:
            return False, computed, 0
        if must_fit:
            gate = 0
            for g in range(self.num_groups):
                size = self.block_sizes[g]
                blocks_needed = cdiv(min(num_tokens, self.max_model_len), size)
                if self.kinds[g] != FULL:
                    blocks_needed = min(blocks_needed, self.caps[g])
                skipped, _, touched, base, _, _ = plan[g]
                held = base if running else max(skipped, len(hit_lists[g]))
                gate += max(blocks_needed - held, 0)
                if not running:
                    gate += sum(1 for b in touched if self.ref[b] == 0)
            if gate > free_before:
                return False, computed, 0

        if not running:
            self.blocks[slot] = [[] for _ in range(self.num_groups)]
            self.num_cached[slot] = [0] * self.num_groups
        for g, (skipped, freed, touched, base, new_start, count) in enumerate(plan):
            blocks = self.blocks[slot][g]
            if running:
                for i in range(min(skipped, len(blocks))):
                    blocks[i] = NULL
                self._free_blocks(freed)
        for g, (skipped, freed, touched, base, new_start, count) in enumerate(plan):
            if not running:
                hits = hit_lists[g]
                self._touch(touched)
                self.blocks[slot][g] = [NULL if i < skipped else b for i, b in enumerate(hits)]
                self.blocks[slot][g] += [NULL] * (base - len(hits))
                self.num_cached[slot][g] = base
        for g, (skipped, freed, touched, base, new_start, count) in enumerate(plan):
            blocks = self.blocks[slot][g]
            blocks += [NULL] * (new_start - len(blocks))
            blocks += self._take(count)
        if self.enable_caching:
            until = min(computed + new, num_tokens)
            if self.num_groups > 1:
                until = until // self.alignment * self.alignment
            for g in range(self.num_groups):
                size = self.block_sizes[g]
                full = until // size
                blocks = self.blocks[slot][g]
                for i in range(self.num_cached[slot][g], full):
                    if blocks[i] == NULL or not self._cacheable(g, i):
                        continue
                    key = self._key(slot, g, i)
                    assert self.key_of[blocks[i]] is None
                    self.key_of[blocks[i]] = key
                    self.cache.setdefault(key, []).append(blocks[i])
                self.num_cached[slot][g] = max(self.num_cached[slot][g], full)
        return True, computed, new

    def _cacheable(self, group, index):
        size = self.block_sizes[group]
        per_segment = self.alignment // size
        tail = cdiv(self.windows[group] - 1, size)
        if self.kinds[group] == SLIDING_WINDOW and tail < per_segment:
            return index % per_segment >= per_segment - tail
        return True

    def free_request(self, slot):
        if slot in self.blocks:
            for g in range(self.num_groups):
                self._free_blocks(list(reversed(self.blocks[slot][g])))
            del self.blocks[slot]
            del self.num_cached[slot]

    def num_common_prefix_blocks(self):
        """vLLM's ``get_num_common_prefix_blocks`` per group (``block.ref_cnt == len(req_to_blocks)`` over the
        blocks of one running request), for every kind of group, a null block ending the count."""
        if not self.blocks:
            return [0] * self.num_groups
        first = self.blocks[min(self.blocks)]
        counts = []
        for g in range(self.num_groups):
            count = 0
            for block in first[g]:
                if block == 0 or self.ref[block] != len(self.blocks):
                    break
                count += 1
            counts.append(count)
        return counts

    def reset_prefix_cache(self):
        if len(self.free) != self.num_blocks - 1:
            return False
        self.cache.clear()
        self.key_of = [None] * self.num_blocks
        return True
