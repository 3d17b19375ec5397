# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""The simulator's timers in order of when they fall due (compiled core).

router.bench.virtual_time's light loop keeps every timer of a simulated fleet waiting here: one
for each session thinking and each turn running, some 70,000 at a thousand replicas. A heap of
``(when, order, timer)`` tuples spends most of a pop fetching scattered tuples and floats from
memory; here the keys are a flat array of ``(when, order)`` pairs, and the timers a list beside
it. The order is the same: by time, then by the order they were pushed. Its pure-Python twin,
router/_timers_py.py, answers alike (tests/unit/test_virtual_time.py runs both).
"""

from cpython.mem cimport PyMem_Free, PyMem_Realloc


cdef struct Entry:
    double when
    unsigned long long order
    Py_ssize_t slot  # where its timer is in ``items``


cdef inline bint _before(Entry* a, Entry* b) noexcept nogil:
    return a.when < b.when or (a.when == b.when and a.order < b.order)


cdef class TimerHeap:
    """Timers by ``(when, the order pushed)``; each timer has a ``cancelled`` attribute."""

    cdef Entry* entries
    cdef Py_ssize_t n, capacity
    cdef unsigned long long pushed
    cdef list items  # the timers, by slot (None where free)
    cdef list free  # slots free for the next push

    def __cinit__(self):
        self.entries = NULL
        self.n = self.capacity = 0
        self.pushed = 0
        self.items = []
        self.free = []

    def __dealloc__(self):
        PyMem_Free(self.entries)

    def __len__(self):
        return self.n

    def push(self, double when, item):
        """Keep ``item`` until ``when`` (after those pushed before it for the same time)."""
        cdef Entry e
        cdef Py_ssize_t i, parent, capacity
        cdef Entry* grown
        if self.n == self.capacity:
            capacity = max(64, 2 * self.capacity)
            grown = <Entry*>PyMem_Realloc(self.entries, capacity * sizeof(Entry))
            if grown is NULL:
                raise MemoryError()
            self.entries, self.capacity = grown, capacity
        if self.free:
            e.slot = self.free.pop()
            self.items[e.slot] = item
        else:
            e.slot = len(self.items)
            self.items.append(item)
        e.when = when
        e.order = self.pushed
        self.pushed += 1
        i = self.n
        self.n += 1
        while i > 0:
            parent = (i - 1) >> 1
            if not _before(&e, &self.entries[parent]):
                break
            self.entries[i] = self.entries[parent]
            i = parent
        self.entries[i] = e

    cdef object _pop(self):
        cdef Entry top = self.entries[0]
        cdef Entry last
        cdef Py_ssize_t i = 0, child, n
        self.n -= 1
        n = self.n
        if n:
            last = self.entries[n]
            while True:
                child = 2 * i + 1
                if child >= n:
                    break
                if child + 1 < n and _before(&self.entries[child + 1], &self.entries[child]):
                    child += 1
                if not _before(&self.entries[child], &last):
                    break
                self.entries[i] = self.entries[child]
                i = child
            self.entries[i] = last
        item = self.items[top.slot]
        self.items[top.slot] = None
        self.free.append(top.slot)
        return item

    def first_when(self):
        """When the first timer falls due (IndexError where none waits)."""
        if not self.n:
            raise IndexError("no timer waits")
        return self.entries[0].when

    def drop_cancelled(self):
        """Drop the cancelled timers at the front."""
        while self.n and self.items[self.entries[0].slot].cancelled:
            self._pop()

    def take_due(self, double now, into):
        """Take out every timer due at or before ``now``, in order; append those not cancelled to ``into``."""
        append = into.append
        while self.n and self.entries[0].when <= now:
            item = self._pop()
            if not item.cancelled:
                append(item)

    def clear(self):
        self.n = 0
        self.items = []
        self.free = []
