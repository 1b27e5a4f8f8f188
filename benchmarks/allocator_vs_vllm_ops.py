"""Our allocator against vLLM 0.33's `KVCacheManager`, op by op, on scheduler workloads with prefix hits,
chunked prefill, decodes, frees, preemption and a pool that runs out.

Both allocators get the same requests and sampled tokens and are driven by one scheduler that follows vLLM's
(`vllm/v1/core/sched/scheduler.py`, synchronous engine, FCFS): each step schedules the running requests first, in
order, each for ``min(tokens left, token budget)`` tokens; when a running request's allocation fails, the last
running request is preempted by recompute (its blocks freed, its computed tokens reset to 0, back to the head of
the waiting queue) and the allocation retried, until it fits or the request preempted itself. Waiting requests
(new or preempted) are admitted only in a step that preempted nothing, while fewer than `MAX_RUNNING` run: vLLM
looks up their prefix hits (`get_computed_blocks`) and allocates ``min(tokens left after hits, budget)`` tokens
with the hits and the admission gate (``full_sequence_must_fit``, vLLM's default); the first that fails stops the
admissions. After the step, every request that computed all its tokens samples one (appended on both sides; vLLM
hashes blocks as they fill) and finishes (is freed) when it reached its output length.

After every op (an allocation, a preemption, a free) the two are compared: success, scheduled tokens, prefix-hit
tokens and hit blocks (our `get_computed_blocks` preview against vLLM's lookup) and, on success, the hits our step
found, every live request's block ids in every group, the number of free blocks and the free queue, head to tail.
A workload stops at its first mismatching op (the states have diverged; later ops would only repeat it), and the
script exits with status 1 if any workload mismatched.

The documented differences (`jax_hybrid_attn.allocator`'s docstring), and how each is allowed:
  * Prefix hits are searched inside our `allocate_slots`: a new or preempted request gets the token budget (our
    step clips it to the tokens left after its hits), vLLM the exact count after its lookup. Both then must report
    the same hits and scheduled tokens.
  * A failed allocation leaves our state unchanged, while vLLM has already freed the request's blocks that left
    its window or chunk. Only after a failed allocation of a running request, and only then, the states may differ,
    and exactly so: that request's vLLM table is ours with some entries replaced by the null block, every other
    table is the same, and vLLM's free queue is ours plus some of those blocks. Once that is checked, vLLM is
    rolled back to its state before the call (a deep copy taken just before it, only when ours had failed), which
    is our semantics; everything after is compared exactly. Without the rollback the free queues would keep the
    freed blocks in another order (vLLM frees them before the preempted request's, we after), and later block ids
    would differ. Each rollback is counted.

    .venv-vllm/bin/python benchmarks/allocator_vs_vllm_ops.py [--configs gemma3 ...] [--workloads ...] [--seed 0]

Sizes are small (block 4, windows and chunks of 16 tokens, prompts of 9-59 tokens, pools of 8-149 blocks) so
that windows and chunks are crossed many times. Each workload compiles our step anew (the pool size and token
budget are static shapes of it).

The table, per configuration and workload: ops compared (allocations, preemptions and frees, each followed by
the full comparison), allocations that succeeded, failures (allocations that did not fit: admissions refused by
the gate and running requests that were then preempted), prefix-hit tokens of the admitted requests, hit blocks
that sat in the free queue (of which at its head: among the entries that the admission consumed), preemptions,
rollbacks of vLLM after a failure (see above), mismatching ops.
"""

import argparse
import collections
import copy
import dataclasses
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax.numpy as jnp

# Sets one torch thread before vLLM imports torch (see vllm_peer).
from vllm_peer import request_factory, vllm_kv_cache_manager

import jax_hybrid_attn
from jax_hybrid_attn import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec
from jax_hybrid_attn.allocator import AllocatorConfig, KVCacheManager

BLOCK = 4
MAX_MODEL_LEN = 96
MAX_RUNNING = 4  # vLLM's max_num_seqs: requests running at once
SLOTS = 8  # our request slots: running, preempted and waiting requests that were added
VOCAB = 1000
FAMILY_BLOCKS = (2, 12)
_LAYER = {"block_size": BLOCK, "num_kv_heads": 1, "head_size": 4, "dtype": jnp.float32}
FULL = FullAttentionSpec(**_LAYER)
WINDOW = SlidingWindowSpec(**_LAYER, sliding_window=16)
CHUNKED = ChunkedLocalAttentionSpec(**_LAYER, attention_chunk_size=16)

CONFIGS = {
    "full": (FULL,),
    "sliding": (WINDOW,),
    "gemma3": (FULL,) + (WINDOW,) * 5,  # 1 full + 5 sliding-window groups, full first
    "llama4": (CHUNKED,) * 3 + (FULL,),  # 3 chunked-local groups + 1 full, full last
}


@dataclasses.dataclass(frozen=True)
class Workload:
    budget_blocks: int  # token budget of a step (max_num_batched_tokens), in blocks
    pool: float  # usable blocks, as a multiple of the most one request can hold
    num_requests: int
    repeat: float  # chance that a request repeats an earlier prompt exactly
    num_families: int = 4  # shared prefixes of FAMILY_BLOCKS blocks (+ 0-3 tokens); a request adds 1-8 tokens
    max_output: int = 16
    arrival: float = 0.5  # chance that a request arrives in a step (while a slot is free)

    @property
    def longest(self) -> int:
        """Most tokens of one request: the pool is sized from it, the same for every seed (one compile)."""
        return (FAMILY_BLOCKS[1] + 1) * BLOCK - 1 + 2 * BLOCK + self.max_output


WORKLOADS = {
    "families": Workload(budget_blocks=3, pool=2.5, num_requests=40, repeat=0.25),
    # many requests at once in a pool of 1.5 requests: admissions fail, running requests fail and are preempted
    "tight": Workload(budget_blocks=2, pool=1.5, num_requests=60, repeat=0.3, arrival=0.8),
    # a one-block budget, few requests at a time and a pool that barely holds one: a new request's hits are often
    # blocks of finished requests at the head of the free queue, and outnumber the blocks one step may take (what
    # handed out the null block before f1d59a9)
    "head-hits": Workload(
        budget_blocks=1, pool=1.1, num_requests=30, repeat=0.7, num_families=2, max_output=6, arrival=0.2
    ),
}


class Mismatch(Exception):
    pass


def make_requests(workload: Workload, rng: random.Random):
    """[(request id, prompt, output length)], seeded."""

    def tokens(n):
        return [rng.randrange(VOCAB) for _ in range(n)]

    families = [
        tokens(rng.randint(*FAMILY_BLOCKS) * BLOCK + rng.randrange(BLOCK))
        for _ in range(workload.num_families)
    ]
    prompts, requests = [], []
    for i in range(workload.num_requests):
        if prompts and rng.random() < workload.repeat:
            prompt = rng.choice(prompts)
        else:
            prompt = rng.choice(families) + tokens(rng.randint(1, 2 * BLOCK))
            prompts.append(prompt)
        requests.append((f"r{i}", prompt, rng.randint(1, workload.max_output)))
    return requests


def allocator_config(specs, workload: Workload) -> AllocatorConfig:
    """The pool: `workload.pool` times the blocks that one request of `workload.longest` tokens can hold at once."""
    budget, longest = workload.budget_blocks * BLOCK, workload.longest
    peak = sum(
        s.max_num_blocks_per_request(max_model_len=longest, max_num_batched_tokens=budget) for s in specs
    )
    return AllocatorConfig(
        specs=specs,
        num_blocks=1 + math.ceil(workload.pool * peak),
        max_num_seqs=SLOTS,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=budget,
    )


@dataclasses.dataclass(frozen=True)
class View:
    """What is compared: block ids per live request and group, the free queue (head first), the free count."""

    ids: dict
    queue: list
    num_free: int


class SideBySide:
    """Our `KVCacheManager` and vLLM's, driven op by op by one vLLM-like scheduler, compared after each op."""

    def __init__(self, config: AllocatorConfig, rng: random.Random):
        from vllm.v1.request import RequestStatus

        self.status = RequestStatus
        self.config, self.rng = config, rng
        self.ours = KVCacheManager(config)
        self.theirs = vllm_kv_cache_manager(config)
        self.null = self.theirs.block_pool.null_block.block_id
        self.make_request = request_factory(math.gcd(*config.block_sizes))
        self.requests = {}  # live requests (added on our side): id -> vLLM Request
        self.running, self.waiting = [], collections.deque()
        self.tally = collections.Counter()
        # `copy.deepcopy` of vLLM's manager recurses along its free queue, a linked list of blocks
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 50 * config.num_blocks))

    # ---------------------------------------------------------------------------------------- comparison

    def views(self) -> tuple[View, View]:
        pool = self.theirs.block_pool
        ours = View(
            {rid: self.ours.get_block_ids(rid) for rid in self.requests},
            self.ours.free_block_queue(),
            self.ours.num_free_blocks,
        )
        theirs = View(
            {rid: [list(g) for g in self.theirs.get_block_ids(rid)] for rid in self.requests},
            [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
            pool.get_num_free_blocks(),
        )
        return ours, theirs

    def check(self, op: str, **pairs):
        """Compare after `op`: each ``name=(ours, vLLM)`` pair, then the full state."""
        self.tally["ops compared"] += 1
        ours, theirs = self.views()
        problems = [f"{name}: ours {a}, vLLM {b}" for name, (a, b) in pairs.items() if a != b]
        problems += [
            f"{rid} block ids: ours {ours.ids[rid]}, vLLM {theirs.ids[rid]}"
            for rid in self.requests
            if ours.ids[rid] != theirs.ids[rid]
        ]
        if ours.num_free != theirs.num_free:
            problems.append(f"free blocks: ours {ours.num_free}, vLLM {theirs.num_free}")
        if ours.queue != theirs.queue:
            problems.append(f"free queue: ours {ours.queue}, vLLM {theirs.queue}")
        if problems:
            raise Mismatch(f"op {self.tally['ops compared']} ({op}): " + "; ".join(problems))

    def check_failure_difference(self, rid: str) -> bool:
        """After a failed allocation of running request `rid`: check that the states differ only as documented
        (vLLM nulled and freed some of its blocks). Returns whether they differ at all."""
        ours, theirs = self.views()
        nulled, problems = set(), []
        for other in self.requests:
            mine, peer = ours.ids[other], theirs.ids[other]
            if mine == peer:
                continue
            if other != rid or [len(g) for g in mine] != [len(g) for g in peer]:
                problems.append(f"{other}: ours {mine}, vLLM {peer}")
                continue
            for a, b in zip((a for g in mine for a in g), (b for g in peer for b in g)):
                if a != b and b != self.null:
                    problems.append(f"{rid}: vLLM holds {b} where ours holds {a}")
                elif a != b:
                    nulled.add(a)
        extra = [b for b in theirs.queue if b not in set(ours.queue)]
        if not set(extra) <= nulled or [b for b in theirs.queue if b not in extra] != ours.queue:
            problems.append(f"free queue: ours {ours.queue}, vLLM {theirs.queue}, nulled {sorted(nulled)}")
        if theirs.num_free != ours.num_free + len(extra):
            problems.append(f"free blocks: ours {ours.num_free}, vLLM {theirs.num_free}, freed {extra}")
        if problems:
            raise Mismatch(f"after the failed allocation of {rid}: " + "; ".join(problems))
        return bool(nulled)

    # ---------------------------------------------------------------------------------------- ops

    def arrive(self, rid: str, prompt: list[int], max_tokens: int):
        self.ours.add_request(rid, prompt)
        self.requests[rid] = self.make_request(rid, prompt, max_tokens)
        self.waiting.append(rid)

    def allocate_running(self, rid: str, num_new: int) -> bool:
        request = self.requests[rid]
        out = self.ours.schedule([(rid, num_new)])
        ok = bool(out.success[0])
        # Only when ours failed: vLLM's state before the call, to roll back to (its requests are not copied).
        saved = None if ok else copy.deepcopy(self.theirs, {id(r): r for r in self.requests.values()})
        theirs_ok = self.theirs.allocate_slots(request, num_new) is not None
        if not ok and not theirs_ok and self.check_failure_difference(rid):
            self.theirs = saved
            self.tally["vLLM rolled back"] += 1
        scheduled = int(out.num_scheduled_tokens[0]) if ok else num_new
        self.tally["allocations" if ok else "failures"] += 1
        self.check(f"allocate {rid} +{num_new}", success=(ok, theirs_ok), scheduled=(scheduled, num_new))
        return ok

    def allocate_waiting(self, rid: str, budget: int) -> int:
        """Admit a new or preempted request; returns its scheduled tokens (0: it did not fit)."""
        request = self.requests[rid]
        blocks, hits, _ = self.theirs.get_computed_blocks(request)
        preview, preview_hits = self.ours.get_computed_blocks(rid)
        pool = self.theirs.block_pool
        queue = [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]
        num_free = pool.get_num_free_blocks()
        from_queue = [
            queue.index(b.block_id) for g in blocks.blocks for b in g if b.ref_cnt == 0 and not b.is_null
        ]
        num_new = min(request.num_tokens - hits, budget)
        out = self.ours.schedule([(rid, budget)], full_sequence_must_fit=[True])
        ok = bool(out.success[0])
        theirs_ok = (
            self.theirs.allocate_slots(request, num_new, hits, blocks, full_sequence_must_fit=True)
            is not None
        )
        pairs = {
            "success": (ok, theirs_ok),
            "hit_tokens": (preview_hits, hits),
            "hit_blocks": (preview, [list(g) for g in blocks.get_block_ids()]),
        }
        if ok:
            pairs["step_hits"] = (int(out.num_new_computed_tokens[0]), hits)
            pairs["scheduled"] = (int(out.num_scheduled_tokens[0]), num_new)
        self.tally["allocations" if ok else "failures"] += 1
        self.check(f"admit {rid} (budget {budget})", **pairs)
        if not ok:
            return 0
        request.status, request.num_computed_tokens = self.status.RUNNING, hits
        self.tally["prefix-hit tokens"] += hits
        self.tally["free-queue hit blocks"] += len(from_queue)
        # hits among the queue entries this allocation consumed (touched or taken): the head of the free queue
        consumed = num_free - self.theirs.block_pool.get_num_free_blocks()
        self.tally["of which at the head"] += sum(position < consumed for position in from_queue)
        return num_new

    def preempt(self, rid: str):
        """vLLM's preemption by recompute: free the blocks, reset the computed tokens, back to the waiting head."""
        request = self.requests[rid]
        self.ours.preempt(rid)
        self.theirs.free(request)
        request.status, request.num_computed_tokens = self.status.PREEMPTED, 0
        request.num_preemptions += 1
        self.waiting.appendleft(rid)
        self.tally["preemptions"] += 1
        self.check(f"preempt {rid}")

    def finish(self, rid: str):
        request = self.requests.pop(rid)
        self.ours.free(rid)
        self.theirs.free(request)
        request.status = self.status.FINISHED_LENGTH_CAPPED
        self.check(f"free {rid}")

    # ---------------------------------------------------------------------------------------- the scheduler

    def schedule_running(self, budget: int, scheduled: dict) -> tuple[int, bool]:
        """vLLM's running loop; returns (budget left, whether it preempted)."""
        preempted, index = False, 0
        while index < len(self.running) and budget > 0:
            rid = self.running[index]
            request = self.requests[rid]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.allocate_running(rid, num_new):
                victim = self.running.pop()
                self.preempt(victim)
                preempted = True
                if victim == rid:
                    return budget, preempted
            scheduled[rid] = num_new
            budget -= num_new
            index += 1
        return budget, preempted

    def schedule_waiting(self, budget: int, scheduled: dict):
        while self.waiting and budget > 0 and len(self.running) < MAX_RUNNING:
            rid = self.waiting[0]
            num_new = self.allocate_waiting(rid, budget)
            if not num_new:
                return
            self.running.append(self.waiting.popleft())
            scheduled[rid] = num_new
            budget -= num_new

    def step(self) -> dict:
        """One scheduler step, then the model's: scheduled tokens computed, one token sampled per request that
        computed all its tokens, finished requests freed. Returns {request id: scheduled tokens}."""
        scheduled = {}
        budget, preempted = self.schedule_running(self.config.max_num_batched_tokens, scheduled)
        if not preempted:
            self.schedule_waiting(budget, scheduled)
        for rid, num_new in scheduled.items():
            request = self.requests[rid]
            request.num_computed_tokens += num_new
            if self.ours.num_computed_tokens(rid) != request.num_computed_tokens:
                raise Mismatch(
                    f"{rid} computed tokens: ours {self.ours.num_computed_tokens(rid)}, vLLM "
                    f"{request.num_computed_tokens}"
                )
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk
            token = self.rng.randrange(VOCAB)
            self.ours.append_token_ids(rid, [token])
            request.append_output_token_ids(token)
            if request.num_output_tokens >= request.max_tokens:
                self.running.remove(rid)
                self.finish(rid)
        return scheduled


def run_workload(specs, workload: Workload, seed: int) -> tuple[collections.Counter, str | None]:
    """Run one workload side by side. Returns (tally, the first mismatch or None)."""
    rng = random.Random(seed)
    pending = collections.deque(make_requests(workload, rng))
    side = SideBySide(allocator_config(specs, workload), rng)
    idle = 0
    try:
        while pending or side.requests:
            while (
                pending
                and len(side.requests) < SLOTS
                and (not side.requests or rng.random() < workload.arrival)
            ):
                side.arrive(*pending.popleft())
            idle = 0 if side.step() else idle + 1
            if idle > 3:
                raise Mismatch(
                    f"stalled (no request scheduled): running {side.running}, waiting {side.waiting}"
                )
    except Mismatch as error:
        side.tally["mismatches"] += 1
        return side.tally, str(error)
    return side.tally, None


COLUMNS = (
    "ops compared",
    "allocations",
    "failures",
    "prefix-hit tokens",
    "free-queue hit blocks",
    "of which at the head",
    "preemptions",
    "vLLM rolled back",
    "mismatches",
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import vllm

    print(f"jax_hybrid_attn from {jax_hybrid_attn.__file__}; vLLM {vllm.__version__}")
    print("| config | workload | " + " | ".join(COLUMNS) + " | seconds |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    failed = []
    for config_name in args.configs:
        for workload_name in args.workloads:
            start = time.perf_counter()
            seed = args.seed * len(WORKLOADS) + list(WORKLOADS).index(workload_name)
            tally, error = run_workload(CONFIGS[config_name], WORKLOADS[workload_name], seed)
            if error:
                failed.append(f"{config_name}/{workload_name}: {error}")
            cells = " | ".join(str(tally[c]) for c in COLUMNS)
            print(
                f"| {config_name} | {workload_name} | {cells} | {time.perf_counter() - start:.1f} |",
                flush=True,
            )
    for line in failed:
        print("MISMATCH", line[:4000])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
