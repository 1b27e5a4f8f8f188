"""The host's estimate of the prefix cache, so that the scheduler budgets a new request's uncached tokens only.

The prefix cache lives on the device (the allocator finds a request's hits inside its step), and the scheduler
never waits to read it. Without an estimate, a new request behind a cached 4,096-token system prompt takes 4,096
more tokens of the step's budget than the step computes, and a step holds a few such requests instead of dozens.

`CachedPrefixes` keeps a chain hash of every full hash block of the prompts computed so far (least recently used
first out, at most the pool's worth), as the allocator hashes them. A guess never changes what the engine
computes, only how fast: the allocator computes ``min(budget, tokens left after its real hits)``, so a guess too
high (blocks evicted since) leaves the rest of the prompt to the next steps, and one too low wastes budget.
"""

import collections
import itertools
from collections.abc import Sequence

__all__ = ["CachedPrefixes"]


class CachedPrefixes:
    """Chain hashes of the full blocks of the prompts computed so far.

    Args:
      block_size: tokens per hash block (the allocator's ``hash_block_size``).
      alignment: hits come in multiples of this many tokens (the allocator's ``alignment``).
      capacity: most hash blocks remembered (the pool's).
      first_lookup_blocks: hash blocks in the first block of the allocator's first full-attention group (whose
        miss rules a hit out), or 0 when it has none.
    """

    def __init__(self, *, block_size: int, alignment: int, capacity: int, first_lookup_blocks: int):
        self.block_size, self.alignment, self.capacity = block_size, alignment, capacity
        self.first_lookup_blocks = first_lookup_blocks
        self._hashes: collections.OrderedDict[int, None] = collections.OrderedDict()

    def _chain(self, tokens: Sequence[int]):
        """The chain hash of each full block of `tokens`, in order."""
        digest = 0
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            digest = hash((digest, tuple(tokens[start : start + self.block_size])))
            yield digest

    def insert(self, tokens: Sequence[int]) -> None:
        """Remember the full blocks of `tokens` (a prompt now in the cache) as the most recently used."""
        for digest in self._chain(tokens):
            self._hashes[digest] = None
            self._hashes.move_to_end(digest)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def hit_tokens(self, tokens: Sequence[int]) -> int:
        """The prefix of `tokens` the cache is expected to hold: whole blocks, aligned, and never the last token
        (which the step computes to sample from)."""
        blocks = 0
        for digest in self._chain(tokens):
            if digest not in self._hashes:
                break
            blocks += 1
        hit = min(blocks * self.block_size, len(tokens) - 1)
        return max(hit, 0) // self.alignment * self.alignment

    def may_hit(self, tokens: Sequence[int]) -> bool:
        """Whether a new request of `tokens` may find a prefix hit, as the allocator's first test sees it (before
        it searches): at least ``alignment`` tokens before the last, and the first full-attention block cached (or
        no full-attention group to rule a hit out)."""
        if len(tokens) - 1 < self.alignment:
            return False
        if not self.first_lookup_blocks:
            return True
        digests = list(itertools.islice(self._chain(tokens), self.first_lookup_blocks))
        return len(digests) == self.first_lookup_blocks and digests[-1] in self._hashes

    def clear(self) -> None:
        self._hashes.clear()
