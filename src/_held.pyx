# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""The part of a price's read of the engines' events that visits every replica (compiled core).

router.placement.events.events_rows reads what each replica's events say it holds of a prompt on
every request: at a thousand replicas its loops over the fleet were most of a decision's time.
``read_plain`` is those loops: the replicas laid out for the pass are read from flat arrays, the
few judged on each request and the maps of requests in flight attribute by attribute, as Python
reads them. ``under`` scans a price for the candidates whose evictions may be asked, and ``lost``
is the loop of each such ask over the conversations likely back. What they read and why is said
in their pure-Python twin, router/_held_py.py, which answers alike
(tests/unit/test_held.py compares them).
"""

from array import array

from libc.math cimport exp, expm1

REMOVED = "removed"


cdef int _hold(const int[:] positions, const int[:] holders, const int[:] block_sizes, Py_ssize_t n,
               const unsigned char[:] excluded, double[:] known, int[:] sizes, dict matches, truth,
               tokens) except -1:
    """Positions' tokens held: each one's holder's match at its block size."""
    cdef Py_ssize_t i, k
    cdef long size, last_size = 0
    cdef int[:] matched
    for k in range(n):
        i = positions[k]
        if excluded[i]:
            continue
        size = block_sizes[k]
        if size != last_size:
            matched = truth.matched(tokens, size, matches)
            last_size = size
        known[i] = matched[holders[k]] * <double>size
        sizes[i] = size
    return 0


def read_plain(layout, const unsigned char[:] excluded, double[:] known, int[:] sizes, list slow,
               truth, tokens, dict matches):
    """Fills ``known`` (tokens held) and ``sizes`` (block size; 0: not read here) for the positions
    read in the pass, as ``layout`` judged them (the twin says how); appends to ``slow`` those to
    ask one by one."""
    cdef Py_ssize_t i, k, m = 0, gpu, n_chain, at_word
    cdef long size
    cdef unsigned long long block
    cdef const int[:] positions, holders, block_sizes, words
    cdef int[:] read_at, read_holders, read_sizes
    cdef const unsigned long long[:] rows
    cdef Py_ssize_t sure_at, block_at, second_at
    cdef object entry, r, h, said, obj, state, rid, queued, coming, chain
    cdef tuple t
    cdef list judge
    positions, holders, block_sizes = layout.fast
    _hold(positions, holders, block_sizes, positions.shape[0], excluded, known, sizes, matches, truth, tokens)
    slow.extend(layout.slow)
    judge = list(layout.dynamic)
    positions, holders, words = layout.followed
    n = positions.shape[0] + len(judge)
    read_at, read_holders, read_sizes = array("i", bytes(4 * n)), array("i", bytes(4 * n)), array("i", bytes(4 * n))
    if positions.shape[0]:
        rows = layout.rows
        sure_at, block_at, second_at = layout.row_words
        for k in range(positions.shape[0]):
            i = positions[k]
            if excluded[i]:
                continue
            at_word = words[k]
            block = rows[at_word + block_at]
            if block == 0 or rows[at_word + second_at] != 0:
                judge.append(layout.followed_entries[k])  # (its metrics' block size; another tier begun)
            elif rows[at_word + sure_at] == 0:
                slow.append(i)
            else:
                read_at[m], read_holders[m], read_sizes[m] = i, holders[k], <int>block
                m += 1
    for entry in judge:
        t = <tuple>entry
        i = t[0]
        if excluded[i]:
            continue
        r = t[1]
        h = t[2]
        obj = h.block_size
        if obj is None or not obj:  # (its events have not said one yet: its metrics' may have)
            said = r.engine.block_size
            size = int(said) if said else 0
        else:
            size = obj
        if size == 0 or not h.sure or len(<dict>t[3]) != 1:
            slow.append(i)
            continue
        state = r.health.state
        if state is REMOVED or state == REMOVED:
            slow.append(i)
            continue
        read_at[m], read_holders[m], read_sizes[m] = i, t[4], size
        m += 1
    _hold(read_at, read_holders, read_sizes, m, excluded, known, sizes, matches, truth, tokens)
    cdef dict at = layout.at
    cdef dict queued_by = truth.queued
    for rid, queued in queued_by.items():
        if not queued:
            continue
        obj = at.get(rid)
        if obj is None:
            continue
        i = obj
        if sizes[i]:
            sizes[i] = 0
            known[i] = -1.0
            slow.append(i)
    cdef dict coming_by = truth.coming
    cdef dict chains = {}
    for rid, coming in coming_by.items():
        if not coming:
            continue
        obj = at.get(rid)
        if obj is None:
            continue
        i = obj
        size = sizes[i]
        if not size:
            continue
        chain = chains.get(size)
        if chain is None:
            chain = chains[size] = tokens.chain(size)
        n_chain = len(chain)
        gpu = (<Py_ssize_t>known[i]) // size
        if gpu < n_chain and chain[gpu] in coming:
            while gpu < n_chain and chain[gpu] in coming:
                gpu += 1
            known[i] = gpu * <double>size


def under(const double[:] cost, const unsigned char[:] flags, double limit, unsigned char candidate,
          unsigned char gated):
    """The positions that are candidates not past the gate (``flags``) and cost at most ``limit``."""
    cdef list out = []
    cdef Py_ssize_t i
    for i in range(cost.shape[0]):
        if cost[i] <= limit and flags[i] & candidate and not flags[i] & gated:
            out.append(i)
    return out


cdef Py_ssize_t _common(const unsigned long long[:] a, const unsigned long long[:] b) noexcept:
    """How many leading blocks two chains share (chained keys: equal at k, equal before k)."""
    cdef Py_ssize_t lo = 0, hi = min(a.shape[0], b.shape[0]), mid
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def lost(kept, list counts, const unsigned long long[:] chain, double now, double spare_s):
    """Blocks of the returning conversations ``kept`` that a request of prompt ``chain`` would
    evict, weighed by how likely each comes back for them within ``spare_s`` (the twin says how)."""
    cdef double total = 0.0, back
    cdef long long had, left
    cdef Py_ssize_t i = 0
    for rec in kept:
        had = counts[i]
        left = counts[i + 1]
        i += 2
        if not had:
            continue
        if left < had:  # (what it shares with the request is pinned by it: not lost)
            left = max(left, min(had, <long long>_common(rec.keys, chain)))
        if left < had:
            back = rec.back_s
            total += (had - left) * exp((<double>rec.at - now) / back) * -expm1(-spare_s / back)
    return total
