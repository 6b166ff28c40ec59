"""RocksDB memory for the worker's tables: one budget per worker, not per table partition.

Faust opens one RocksDB database per partition of every table (8 tables, ~50 databases per worker) and gives each its
own memtables (64 MiB × 3) and block cache (2 GiB). Nothing flushes a memtable before it fills, so memtables grow with
every write up to GiBs (the soak's growth was mostly Faust's key index: docs/method.md#a-stream-workers-memory).
Here every database shares one LRU block cache, and one write-buffer manager charges all memtables to that cache and
flushes on the next write once they pass their share: the worker's RocksDB memory stays near ``rocksdb_memory_mb``
however many partitions it owns. A soft limit (no write stalls, which would block the event loop): a burst on a slow
disk ends above the share, at most one write buffer per database besides one being flushed, until the next writes.

Faust builds each store's options from a plain dict; :func:`bound` replaces the options object of each table's store
before anything opens (stores open their databases on assignment). :meth:`Budget.report` is the periodic log line; it
also hands freed heap back to the system (glibc's ``malloc_trim``, as Dask's workers do): memtables and blocks freed
inside the main heap otherwise stay resident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import tracemalloc
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from clawbase.errors import ConfigError

MIB = 1024 * 1024
WRITE_BUFFER_BYTES = 2 * MIB  # per database: small tables flush early; the manager bounds the sum
MEMTABLE_SHARE = 0.5  # of the budget, charged to the shared cache (the rest holds read blocks)


@dataclass(frozen=True)
class Budget:
    """The shared block cache and write-buffer manager of one worker (rocksdict objects)."""

    cache: Any
    manager: Any
    limit_bytes: int
    trace: PythonHeap | None = None

    def report(self) -> str:
        """RocksDB's use of the budget and the process's resident memory before and after trimming the heap."""
        mb = lambda n: f"{n / MIB:.1f}"  # noqa: E731
        before = rss_bytes()
        trimmed = trim_heap()
        line = (
            f"rocksdb memory {mb(self.cache.get_usage())} MiB of {mb(self.limit_bytes)} "
            f"(memtables {mb(self.manager.get_usage())}, pinned {mb(self.cache.get_pinned_usage())}); "
            f"RSS {mb(before)} MiB" + (f", {mb(rss_bytes())} after malloc_trim" if trimmed else "")
        )
        return line if self.trace is None else f"{line}\n{self.trace.report()}"


@dataclass
class PythonHeap:
    """Diagnosis: the Python allocation sites (tracemalloc, 12 frames) that grew most since the first report."""

    top: int
    baseline: tracemalloc.Snapshot | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(12)

    def report(self) -> str:
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        if self.baseline is None:
            self.baseline = snap
            return f"python heap {sum(s.size for s in snap.statistics('filename')) / MIB:.1f} MiB traced (baseline)"
        stats = snap.compare_to(self.baseline, "traceback")[: self.top]
        lines = [f"python heap growth since the baseline, top {len(stats)}:"]
        for st in stats:
            frames = reversed(st.traceback)  # newest first
            where = " <- ".join(f"{'/'.join(f.filename.rsplit('/', 2)[-2:])}:{f.lineno}" for f in frames)
            lines.append(f"  {st.size_diff / 1024:+.0f} KiB in {st.count_diff:+d} blocks  {where}")
        return "\n".join(lines)


def rss_bytes() -> int:
    """Resident memory of this process now (Linux ``/proc``; the peak from getrusage elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trim_heap() -> bool:
    """Return free heap pages to the system (glibc only; False elsewhere)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        return False
    return True


def budget(memory_mb: float) -> Budget:
    """One cache of ``memory_mb`` with the memtables charged to it."""
    import rocksdict

    limit = int(memory_mb * MIB)
    cache = rocksdict.Cache(limit)
    wbm = rocksdict.WriteBufferManager
    manager = wbm.new_write_buffer_manager_with_cache(int(limit * MEMTABLE_SHARE), False, cache)  # no stalls
    return Budget(cache, manager, limit)


def _options_class() -> type:
    from faust.stores.rocksdb import RocksDBOptions

    class SharedOptions(RocksDBOptions):  # type: ignore[misc,valid-type]
        """Faust's options with the worker's shared cache and write-buffer manager (rocksdict driver only)."""

        shared: Budget

        def as_options(self) -> Any:
            import rocksdict

            opts = rocksdict.Options(raw_mode=True)
            opts.create_if_missing(True)
            if self.max_open_files is not None:
                opts.set_max_open_files(self.max_open_files)
            opts.set_write_buffer_size(WRITE_BUFFER_BYTES)
            opts.set_max_write_buffer_number(2)
            opts.set_target_file_size_base(4 * WRITE_BUFFER_BYTES)
            opts.set_write_buffer_manager(self.shared.manager)
            table = rocksdict.BlockBasedOptions()
            table.set_bloom_filter(self.bloom_filter_size, block_based=True)
            table.set_block_cache(self.shared.cache)
            table.set_index_type(rocksdict.BlockBasedIndexType.binary_search())
            opts.set_block_based_table_factory(table)
            return opts

    return SharedOptions


def bound(tables: Iterable[Any], memory_mb: float, trace_top: int = 0) -> Budget | None:
    """Give every RocksDB-backed table's store the shared budget; None when no table is on RocksDB (memory://).
    ``trace_top`` > 0: the report also names that many Python allocation sites that grew (:class:`PythonHeap`)."""
    stores = [t.data for t in tables if hasattr(t.data, "rocksdb_options")]
    if not stores:
        return None
    shared = budget(memory_mb)
    if trace_top:
        shared = replace(shared, trace=PythonHeap(trace_top))
    cls = _options_class()
    for store in stores:
        if not store.use_rocksdict:
            raise ConfigError("store: the RocksDB memory budget needs the rocksdict driver (pip install rocksdict)")
        options = cls(use_rocksdict=True, max_open_files=store.rocksdb_options.max_open_files)
        options.shared = shared
        store.rocksdb_options = options
    return shared
