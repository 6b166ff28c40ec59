"""The streams worker bounds Faust's per-table key index (``StreamsSettings.table_key_index_size``): the app as the
worker builds it against the real broker (which it asks how topics are replicated), its stores' index limit, and what
one key costs in it (#29: the soak's streams growth)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("rocksdict")

from streams import store  # noqa: E402

pytestmark = pytest.mark.integration


def test_the_worker_bounds_faust_key_index(kafka_settings, tmp_path: Path) -> None:
    """Faust keeps, per table, an LRU of encoded key → partition (1,000 keys by default). Its JSON key encoding
    (orjson) allocates ~4 KiB per key whatever the key's length, so that index was ~35 MiB over 8 tables, filled over
    minutes of a soak: the worker bounds it (``table_key_index_size``)."""
    import tracemalloc

    from streams.app import TABLES, create_app
    from streams.settings import StreamsSettings

    cfg = StreamsSettings(store="rocksdb://", data_dir=tmp_path)
    app = create_app(cfg, kafka_settings)  # asks the broker only for its replication; no worker starts
    stores = [app.tables[name].data for name in TABLES]
    assert {s._key_index.limit for s in stores} == {cfg.table_key_index_size} == {256}

    was = tracemalloc.is_tracing()
    tracemalloc.start()
    try:
        keys = [stores[0]._encode_key(f"r-{i:06d}-attempt") for i in range(200)]
        per_key = tracemalloc.get_traced_memory()[0] / len(keys)
    finally:
        if not was:
            tracemalloc.stop()
    # What the index can hold at most, all tables together: a few MiB, not Faust's default ~35 MiB.
    assert len(TABLES) * cfg.table_key_index_size * per_key < 12 * store.MIB, per_key
