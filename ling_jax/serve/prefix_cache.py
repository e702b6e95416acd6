"""Exact prefix cache, host side: a tree over token blocks whose nodes own latent pages and KDA snapshots.

MLA latent pages can be shared outright (a page's latents depend only on the tokens up to it); a
KDA slot cannot (one state summarises the whole prefix), so the KDA side of a cached prefix is a
*snapshot*: a copy of the slot's rows (states, conv states, `hidden`) at a page boundary, taken
inside prefill chunks (`plan_boundaries` / `insert_boundaries`) and where a chunk ended on one
(`after_prefill`; `snapshots.py` copies on the device). A hit restores the snapshot of the deepest
matched boundary that has one, shares the pages before it and prefills only the rest, so it reads
exactly the pages and state it would have computed (up to the rounding of another chunking).
The design, with its reasons: serve/README.md, *Prefix cache*.

Tree: the node at depth d covers tokens [(d-1)P, dP) and owns one page id (the same in every MLA
pool and the MTP pool) and, where one was taken, a snapshot row (the state after [0, dP)). Its
key is the block's tokens plus, with MTP pages, one token of lookahead (token dP: the MTP latent
in a block's last position depends on the next block's first token).

What keeps "no page with two writers": a hit at boundary b shares the restore node's ancestors'
pages by reference and gets a private copy of the restore node's own page (it writes MTP slot b-1
there); a request's own pages enter the tree only once it has fed past them (lookahead included),
and it never writes them again; a sequence's partly filled last page never enters the tree.

Locks and eviction: a running request locks the path to its restore node and to its deepest
inserted node. Unlocked nodes are evictable (their pages count as free in `PageAllocator`), least
recently used leaves first; an unlocked leaf always holds a snapshot (one without is pruned); the
tree's bytes stay within `budget_bytes`. Snapshot rows are few (a row costs a whole slot), so a new
snapshot that finds none free takes the least recently used one's row (shallowest first among
equals), locked path or not: nothing reads a snapshot after its restore (restores run before any
snapshot is taken in a step). Pure Python (no device): `check()` asserts every invariant.
"""
from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from typing import Optional

from ling_jax.checks import check_int
from ling_jax.serve.allocator import PageAllocator


@dataclasses.dataclass(eq=False)
class Node:
    """One cached block. depth: blocks from the root (its boundary is depth·P); page: its page id
    (-1 at the root); snapshot: snapshot row of the state at its boundary, or None; locks: running
    requests whose locked path passes here; last_used: LRU clock."""
    parent: Optional["Node"]
    key: tuple
    depth: int
    page: int
    snapshot: Optional[int] = None
    locks: int = 0
    last_used: int = 0
    children: dict = dataclasses.field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.parent is None or self.parent.children.get(self.key) is self


@dataclasses.dataclass(frozen=True)
class Hit:
    """A lookup's answer. node: the restore node (it has a snapshot; boundary = node.depth·P);
    shared: the pages of its ancestors in block order (shared by reference); newly_locked: unlocked
    nodes on its path (free pages now, no longer once the hit locks them)."""
    node: Node
    shared: tuple
    newly_locked: int


@dataclasses.dataclass
class Restore:
    """A device copy the engine runs before the step's programs: snapshot row -> the slot's KDA rows
    and hidden, and page src_page -> dst_page (the copy-on-write of the restore node's page)."""
    req: object
    slot: int
    snapshot: int
    dst_page: int
    src_page: int


@dataclasses.dataclass
class _Held:
    """A request's share of the cache: its locked node, and a snapshot taken but not yet in the tree
    (boundary, row)."""
    lock: Optional[Node] = None
    pending: Optional[tuple] = None
    base: int = 0  # depth of its restore node (0: a miss): deeper nodes on its path are of its own feeding


class PrefixCache:
    """The tree plus its bookkeeping: snapshot rows, byte budget, locks of running requests. alloc: the
    engine's PageAllocator (this becomes its `cache`); num_snapshots: the device snapshot pool's rows;
    page_bytes / snapshot_bytes: what a node's page and snapshot cost; budget_bytes: the most the tree
    may hold; lookahead: 1 when MTP pages are kept. The scheduler calls `lookup` / `admit` on
    admission and `release` when a request leaves its slot; the engine `take_restores` after
    scheduling, `plan_boundaries` / `insert_boundaries` / `after_prefill` around a prefill chunk and
    `commit` at the end of a step."""

    def __init__(self, alloc: PageAllocator, *, num_snapshots: int, page_bytes: int, snapshot_bytes: int,
                 budget_bytes: int, lookahead: int):
        check_int(num_snapshots, "num_snapshots", low=1)
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead must be 0 or 1, got {lookahead}")
        self.alloc, self.P, self.lookahead = alloc, alloc.sizes.page_size, lookahead
        self.num_snapshots, self.page_bytes, self.snapshot_bytes = num_snapshots, page_bytes, snapshot_bytes
        self.budget_bytes = budget_bytes
        self.root = Node(None, (), 0, -1)
        self.free_rows = list(range(num_snapshots - 1, -1, -1))
        self.nodes = 0        # pages held by the tree
        self.snapshots = 0    # snapshot rows attached to nodes
        self.evictable = 0    # unlocked nodes (= evictable pages)
        self.row_owner: dict[int, Node] = {}  # snapshot row -> its node
        self.restores: list[Restore] = []
        self.hits = self.tokens_saved = 0
        self.evictions = 0    # leaves evicted or snapshot rows given up
        self._held: dict = {}
        self._clock = itertools.count(1)
        self._serial = itertools.count()
        self._heap: list = []  # (last_used, serial, node): LRU candidates, checked lazily
        alloc.cache = self

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def bytes(self) -> int:
        return self.nodes * self.page_bytes + self.snapshots * self.snapshot_bytes

    def evictable_pages(self) -> list[int]:
        return [n.page for n in self._walk() if n.locks == 0]

    # -- lookups -------------------------------------------------------------------------------
    def _key(self, tokens, depth: int) -> tuple:
        return tuple(tokens[(depth - 1) * self.P: depth * self.P + self.lookahead])

    def lookup(self, tokens) -> Optional[Hit]:
        """The deepest restore point for a sequence about to be fed: a snapshotted boundary b with
        b <= len(tokens) - 1 (at least one token is fed, for the logits of the next one). Exact-key
        nodes along the path, or, one block deeper, a child whose block matches but whose lookahead
        differs (its page is copied, so its lookahead does not matter)."""
        n, P = len(tokens), self.P
        node, best, d = self.root, None, 1
        while d * P + self.lookahead <= n:
            child = node.children.get(self._key(tokens, d))
            if child is None:
                break
            if child.snapshot is not None and d * P <= n - 1:
                best = child
            node, d = child, d + 1
        if self.lookahead and d * P <= n - 1:
            block = tuple(tokens[(d - 1) * P: d * P])
            near = [c for c in node.children.values() if c.key[:P] == block and c.snapshot is not None]
            if near:
                best = max(near, key=lambda c: c.last_used)
        if best is None:
            return None
        path = self._path(best)
        return Hit(best, tuple(x.page for x in path[:-1]), sum(x.locks == 0 for x in path))

    # -- scheduler hooks -----------------------------------------------------------------------
    def admit(self, req, hit: Hit) -> None:
        """Start `req` (just given its slot) from the hit: lock the path, share the ancestors' pages,
        allocate the copy of the restore node's page, queue the device restore, n_fed = boundary."""
        node, b = hit.node, hit.node.depth * self.P
        self._lock(node)
        self._touch(node)
        self.alloc.share(req.slot, hit.shared)
        if not self.alloc.ensure(req.slot, b):
            raise AssertionError("page accounting out of step (admission checked the hit's pages)")
        self.restores.append(Restore(req, req.slot, node.snapshot, self.alloc.pages[req.slot][-1], node.page))
        req.n_fed = b
        self._held[req] = _Held(lock=node, base=node.depth)
        self.hits += 1
        self.tokens_saved += b

    def release(self, req) -> None:
        """`req` leaves its slot (finish, cancel, preemption): a ready snapshot enters the tree first,
        then the slot's pages are released, then its locks, pending row and restore go (in this
        order: unlocking may prune a node, whose page no slot may hold by then)."""
        held = self._held.pop(req, None)
        if held is not None:
            self._commit(req, held)
        self.alloc.release(req.slot)
        if held is None:
            return
        if held.pending is not None:
            self.free_rows.append(held.pending[1])
        if held.lock is not None:
            self._unlock(held.lock)
        self.restores = [op for op in self.restores if op.req is not req]

    # -- engine hooks --------------------------------------------------------------------------
    def take_restores(self) -> list[Restore]:
        ops, self.restores = self.restores, []
        return ops

    def after_prefill(self, reqs) -> list[tuple[int, int]]:
        """Called once the prefill chunks of `reqs` are fed (n_fed updated): commits what became
        ready and returns the (slot, snapshot row) copies to make now, one per request whose chunk
        ended on a page boundary beyond what it already has in the tree."""
        out = []
        for req in reqs:
            held = self._held.setdefault(req, _Held())
            self._commit(req, held)
            b = req.n_fed
            done = held.lock.depth * self.P if held.lock is not None else 0
            if b % self.P or held.pending is not None or b <= done:
                continue
            row = self._take_row()
            if row is not None:
                held.pending = (b, row)
                out.append((req.slot, row))
        return out

    def plan_boundaries(self, chunks, interval: int) -> list[list[tuple[int, int, int]]]:
        """Snapshots to take *inside* the prefill chunks about to run (`after_prefill` takes the chunk
        ends'): per (req, n) chunk, [(j, boundary, row)] for b = start + (j+1)·interval strictly inside
        it (start = req.n_fed, a page boundary), deeper than the request's part of the tree and not
        cached with a snapshot already, deepest first (kept when rows run out). Rows: free ones, else
        only the request's own shallower snapshots give theirs up, so a long prompt never evicts other
        prefixes' snapshots this way. The program writes each row; `insert_boundaries` inserts them."""
        out = []
        for req, n in chunks:
            held = self._held.setdefault(req, _Held())
            start, plan = req.n_fed, []
            done = held.lock.depth * self.P if held.lock is not None else 0
            if start % self.P == 0:
                tokens = list(req.prompt) + list(req.generated)
                for j in reversed(range((n - 1) // interval)):
                    b = start + (j + 1) * interval
                    if b <= done or self._cached_snapshot(tokens, b):
                        continue
                    row = self._take_row(within=held)
                    if row is None:
                        break
                    plan.append((j, b, row))
            out.append(plan)
        return out

    def insert_boundaries(self, chunks, plans) -> None:
        """After the chunks of `plan_boundaries` were fed (n_fed updated): insert each boundary
        snapshot the program wrote, shallowest first (each extends the request's locked path)."""
        for (req, _), plan in zip(chunks, plans):
            held = self._held.setdefault(req, _Held())
            for _, b, row in sorted(plan, key=lambda p: p[1]):
                self._insert(req, held, b, row)

    def _cached_snapshot(self, tokens, b: int) -> bool:
        """Whether the tree holds boundary b of `tokens` with a snapshot (exact keys)."""
        node = self.root
        for d in range(1, b // self.P + 1):
            node = node.children.get(self._key(tokens, d))
            if node is None:
                return False
        return node.snapshot is not None

    def commit(self, reqs) -> None:
        """Insert every pending snapshot whose blocks are complete (end of an engine step)."""
        for req in reqs:
            held = self._held.get(req)
            if held is not None:
                self._commit(req, held)

    def clear(self) -> None:
        """Evict everything no running request uses."""
        while self.evict_one():
            pass

    # -- insertion -----------------------------------------------------------------------------
    def _take_row(self, within: Optional[_Held] = None) -> Optional[int]:
        """A free snapshot row, else the least recently used snapshot's (see the module docstring);
        with `within` (a request's share), only a snapshot on its locked path below its restore point
        may give its row up (None if there is none)."""
        if not self.free_rows and self.row_owner:
            if within is not None:
                path = self._path(within.lock) if within.lock is not None else []
                own = [n for n in path if n.snapshot is not None and n.depth > within.base]
                if not own:
                    return None
                victim = min(own, key=lambda n: (n.last_used, n.depth))
            else:
                victim = min(self.row_owner.values(), key=lambda n: (n.last_used, n.depth))
            self._detach(victim)
            self._prune(victim)
            self.evictions += 1
        return self.free_rows.pop() if self.free_rows else None

    def _attach(self, node: Node, row: int) -> None:
        node.snapshot = row
        self.row_owner[row] = node
        self.snapshots += 1

    def _detach(self, node: Node) -> None:
        del self.row_owner[node.snapshot]
        self.free_rows.append(node.snapshot)
        node.snapshot = None
        self.snapshots -= 1

    def _commit(self, req, held: _Held) -> None:
        """Insert the blocks up to the pending boundary b once the request fed token b (lookahead) or
        b (none): the path's missing nodes get the request's own pages, the node at b the snapshot."""
        if held.pending is None or req.n_fed < held.pending[0] + self.lookahead:
            return
        (b, row), held.pending = held.pending, None
        self._insert(req, held, b, row)

    def _insert(self, req, held: _Held, b: int, row: int) -> None:
        """Insert the blocks up to boundary b (fed, lookahead included) with snapshot `row` at b, or
        give the row back when b is cached already or the budget has no room."""
        tokens = list(req.prompt) + list(req.generated)
        depth = b // self.P
        node = self.root
        while node.depth < depth:
            child = node.children.get(self._key(tokens, node.depth + 1))
            if child is None:
                break
            node = child
        new = depth - node.depth
        need = new * self.page_bytes + (self.snapshot_bytes if new or node.snapshot is None else 0)
        if need == 0:  # another request cached this boundary already
            self.free_rows.append(row)
            self._relock(held, node)
            return
        self._lock(node)  # the path being extended must survive making room
        while self.bytes + need > self.budget_bytes and self.evict_one():
            pass
        if self.bytes + need > self.budget_bytes:
            self._unlock(node)
            self.free_rows.append(row)
            return
        base = node
        pages = self.alloc.pages[req.slot]
        for d in range(node.depth + 1, depth + 1):
            page = pages[d - 1]
            assert self.alloc.refs[page] == 1 and page not in self.alloc.cached, page  # the request's own
            child = Node(node, self._key(tokens, d), d, page)
            node.children[child.key] = child
            self.alloc.cache_page(page)
            self.nodes += 1
            self.evictable += 1
            node = child
        if node.snapshot is None:
            self._attach(node, row)
        else:
            self.free_rows.append(row)
        self._relock(held, node)
        self._unlock(base)

    # -- locks, LRU ----------------------------------------------------------------------------
    def _path(self, node: Node) -> list[Node]:
        out = []
        while node is not self.root:
            out.append(node)
            node = node.parent
        return out[::-1]

    def _relock(self, held: _Held, node: Node) -> None:
        """Move the request's lock down to `node` (a node on its path). Never up: a chunk-end snapshot
        committed after the deeper snapshots inside the next chunk sits above the lock, and the
        deeper nodes' pages are the request's own."""
        if held.lock is not None and held.lock.depth >= node.depth:
            return  # (nor touched: the deeper lock's touch covered it, and LRU rows go shallowest first)
        self._lock(node)
        if held.lock is not None:
            self._unlock(held.lock)
        held.lock = node
        self._touch(node)

    def _lock(self, node: Node) -> None:
        while node is not self.root:
            if node.locks == 0:
                self.evictable -= 1
            node.locks += 1
            node = node.parent

    def _unlock(self, node: Node) -> None:
        bottom = node
        while node is not self.root:
            node.locks -= 1
            if node.locks == 0:
                self.evictable += 1
                self._push(node)
            node = node.parent
        self._prune(bottom)  # a lock end whose snapshot was given up

    def _prune(self, node: Node) -> None:
        """Remove node and its ancestors while each is an unlocked leaf without a snapshot."""
        while node is not self.root and node.alive and not node.children and node.locks == 0 \
                and node.snapshot is None:
            self._remove(node)
            node = node.parent

    def _touch(self, node: Node) -> None:
        t = next(self._clock)
        self._push(node, t)
        while node is not self.root:
            node.last_used = t
            node = node.parent

    def _push(self, node: Node, t: int | None = None) -> None:
        if node is not self.root and not node.children and node.locks == 0:
            heapq.heappush(self._heap, (node.last_used if t is None else t, next(self._serial), node))
        if len(self._heap) > 4 * self.nodes + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap if self._candidate(e)]
            heapq.heapify(self._heap)

    def _candidate(self, entry) -> bool:
        t, _, node = entry
        return node.alive and not node.children and node.locks == 0 and node.last_used == t

    def evict_one(self) -> bool:
        """Evict the least recently used unlocked leaf (and the snapshot-less ancestors it leaves as
        leaves); False when nothing is evictable."""
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._candidate(entry):
                break
        else:
            return False
        node = entry[2]
        if node.snapshot is not None:
            self._detach(node)
        self._prune(node)
        self.evictions += 1
        return True

    def _remove(self, node: Node) -> None:
        assert node.locks == 0 and not node.children and node.snapshot is None, node.page
        assert self.alloc.refs[node.page] == 0, node.page
        del node.parent.children[node.key]
        self.alloc.uncache_page(node.page)
        self.nodes -= 1
        self.evictable -= 1
        self._push(node.parent)

    # -- checks --------------------------------------------------------------------------------
    def _walk(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def check(self, running=()) -> None:
        """Assert every invariant of the tree, the allocator and the snapshot rows. `running`: the
        requests holding slots (their pages to be written must be theirs alone)."""
        a, P = self.alloc, self.P
        nodes = list(self._walk())
        assert len(nodes) == self.nodes and self.bytes <= self.budget_bytes
        ends: dict = {}
        for held in self._held.values():
            if held.lock is not None:
                assert held.lock.alive
                ends[id(held.lock)] = ends.get(id(held.lock), 0) + 1
        heap = {id(e[2]) for e in self._heap if self._candidate(e)}

        def locks(n):  # lock ends in the subtree
            return ends.get(id(n), 0) + sum(locks(c) for c in n.children.values())

        for n in nodes:
            assert len(n.key) == P + self.lookahead and n.depth == n.parent.depth + 1
            assert n.parent.children[n.key] is n and n.page in a.cached and n.locks == locks(n)
            assert n.children or n.snapshot is not None or n.locks, "an unlocked leaf without a snapshot"
            if n.snapshot is not None:
                assert self.row_owner[n.snapshot] is n
            if n.locks == 0:
                assert a.refs[n.page] == 0, "an unlocked node's page is held by a slot"
                if not n.children:
                    assert id(n) in heap, "an evictable leaf missing from the LRU heap"
        assert sum(n.locks == 0 for n in nodes) == self.evictable
        pages = [n.page for n in nodes]
        assert len(set(pages)) == len(pages) and set(pages) == a.cached
        rows = [n.snapshot for n in nodes if n.snapshot is not None]
        assert len(rows) == self.snapshots == len(self.row_owner)
        rows += [h.pending[1] for h in self._held.values() if h.pending is not None] + self.free_rows
        assert sorted(rows) == list(range(self.num_snapshots)), "snapshot rows lost or doubled"
        held = collections.Counter(p for ps in a.pages.values() for p in ps)
        assert all(a.refs[p] == held.get(p, 0) for p in range(a.sizes.num_pages))
        assert not set(a.empty) & (set(held) | a.cached) and len(set(a.empty)) == len(a.empty)
        assert len(a.empty) + len(set(held) | a.cached) == a.sizes.num_pages
        for req in running:  # the pages it writes next (latents at n_fed.., MTP slot n_fed-1..)
            own = a.pages.get(req.slot, [])
            for p in own[max(req.n_fed - self.lookahead, 0) // P:]:
                assert a.refs[p] == 1 and p not in a.cached, f"request {req.id} would write shared page {p}"

