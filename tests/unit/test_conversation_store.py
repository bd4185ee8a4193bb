"""Stored Responses: SQLite in a temporary directory (two store objects on one file stand for
two worker processes) and a real redis-server; neither may block the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from pathlib import Path

import pydantic
import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ext_proc.api.conversation_store import (
    ConversationStoreConfig,
    RedisResponseStore,
    SqliteResponseStore,
    StoredResponse,
    build_conversation_store,
)
from tests.conftest import free_port
from tests.redis_server import RedisServer, closing

DAY = 24 * 3600.0


def stored(n: int, tenant: str | None = "acme", created_at: float | None = None, body: bytes = b"") -> StoredResponse:
    return StoredResponse(
        id=f"resp_{n}",
        tenant=tenant,
        response=b'{"id": "resp_%d", "object": "response"}' % n + body,
        messages=b'[{"role": "user", "content": "hi \xc3\xa9"}]',
        input_items=b'[{"id": "msg_%d", "type": "message"}]' % n,
        created_at=time.time() if created_at is None else created_at,
    )


def rows(path: Path) -> list[str]:
    """The ids in the file, expired or not (as another process reads it)."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        return [row[0] for row in db.execute("SELECT id FROM responses ORDER BY created_at")]


# -- SQLite --


async def test_sqlite_round_trip_replace_and_delete(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "responses.sqlite3"  # the parent is created
    store = SqliteResponseStore(str(path), DAY, 100)
    async with closing(store):
        first = stored(1, body=bytes(range(256)) * 100)  # any bytes, byte-equal back
        await store.put(first)
        assert await store.get("resp_1") == first
        assert await store.get("resp_2") is None

        replaced = stored(1, tenant=None, body=b" again")
        await store.put(replaced)
        assert await store.get("resp_1") == replaced
        assert rows(path) == ["resp_1"]

        assert await store.delete("resp_1") is True
        assert await store.get("resp_1") is None
        assert await store.delete("resp_1") is False
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == 1


async def test_sqlite_expired_is_never_returned_and_is_swept(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    store = SqliteResponseStore(str(path), 60, 100)
    async with closing(store):
        await store.put(stored(1))  # the first put sweeps; the next ones, a minute later
        await store.put(stored(2, created_at=time.time() - 61))
        assert rows(path) == ["resp_2", "resp_1"]  # still in the file, not swept yet
        assert await store.get("resp_2") is None
        assert await store.delete("resp_2") is False  # expired: it was not there
        assert await store.get("resp_1") is not None

    sweeping = SqliteResponseStore(str(path), 60, 100, sweep_interval_s=0)
    async with closing(sweeping):
        await sweeping.put(stored(3))
        assert rows(path) == ["resp_1", "resp_3"]


async def test_sqlite_cap_deletes_the_oldest(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    store = SqliteResponseStore(str(path), DAY, 3)
    now = time.time()
    async with closing(store):
        for n in (5, 1, 4, 2, 3):  # created in the order 1..5, put in another
            await store.put(stored(n, created_at=now - 10 + n))
        assert rows(path) == ["resp_3", "resp_4", "resp_5"]
        assert await store.get("resp_1") is None
        assert await store.get("resp_5") is not None


async def test_sqlite_two_workers_share_one_file(tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite3")
    one, two = SqliteResponseStore(path, DAY, 100), SqliteResponseStore(path, DAY, 100)
    async with closing(one, two):
        await asyncio.gather(*(store.put(stored(n)) for n in range(20) for store in (one, two)))
        assert await two.get("resp_7") == await one.get("resp_7") is not None
        await one.put(stored(100, tenant="beta"))
        assert await two.get("resp_100") == await one.get("resp_100")
        assert await two.delete("resp_100") is True
        assert await one.get("resp_100") is None
        assert await one.delete("resp_100") is False


async def test_sqlite_opens_a_file_another_worker_is_writing(tmp_path: Path) -> None:
    """Switching to WAL inside a read, SQLite refuses at once ("database is locked", no busy
    timeout) while another connection writes: as when two workers open a new file at once.
    The store retries until the other commits, and opens."""
    path = tmp_path / "responses.sqlite3"
    store = SqliteResponseStore(str(path), DAY, 100)
    async with closing(store):
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            other.execute("CREATE TABLE other_worker (x)")
            opened = asyncio.create_task(store.get("resp_0"))
            await asyncio.sleep(0.2)
            assert not opened.done()
            other.execute("COMMIT")
            assert await asyncio.wait_for(opened, 10) is None


async def test_sqlite_waits_for_another_writer_without_blocking_the_loop(tmp_path: Path) -> None:
    """Another process holds the write lock: the put waits (busy timeout) on the store's
    thread while the loop keeps running, and completes once the lock is released. Had the put
    run on the loop, the loop would freeze, the lock never be released and the put fail."""
    path = tmp_path / "responses.sqlite3"
    store = SqliteResponseStore(str(path), DAY, 100)
    async with closing(store):
        assert await store.get("resp_0") is None  # opened: the schema exists
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            put = asyncio.create_task(store.put(stored(1)))
            ticks = 0
            for _ in range(20):
                await asyncio.sleep(0.01)
                ticks += 1
            assert ticks == 20 and not put.done()
            other.execute("COMMIT")
            await asyncio.wait_for(put, 10)
        got = await store.get("resp_1")
        assert got is not None and got.id == "resp_1"


async def test_sqlite_many_puts_leave_the_loop_ticking(tmp_path: Path) -> None:
    store = SqliteResponseStore(str(tmp_path / "responses.sqlite3"), DAY, 100)
    ticks = 0
    stop = asyncio.Event()

    async def tick() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    async with closing(store):
        ticker = asyncio.create_task(tick())
        for n in range(200):
            await store.put(stored(n, body=b"x" * 10_000))
        stop.set()
        await ticker
    assert ticks >= 200  # at least one tick while each put ran on the store's thread


async def test_sqlite_closed_store_refuses_calls(tmp_path: Path) -> None:
    store = SqliteResponseStore(str(tmp_path / "responses.sqlite3"), DAY, 100)
    await store.put(stored(1))
    await store.close()
    await store.close()  # twice is fine
    with pytest.raises(RuntimeError):
        await store.get("resp_1")


async def test_sqlite_refuses_another_schema_version(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite3"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA user_version = 99")
    store = SqliteResponseStore(str(path), DAY, 100)
    async with closing(store):
        with pytest.raises(RuntimeError, match="schema 99"):
            await store.get("resp_1")


# -- Redis --


async def test_redis_round_trip_replace_delete_and_ttl(redis_server: RedisServer) -> None:
    store = RedisResponseStore(redis_server.url, DAY)
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        first = stored(1, body=bytes(range(256)))
        await store.put(first)
        assert await store.get("resp_1") == first
        assert await store.get("resp_2") is None
        assert DAY - 60 < await client.ttl("tito:response:resp_1") <= DAY

        replaced = stored(1, tenant=None, body=b" again")
        await store.put(replaced)
        assert await store.get("resp_1") == replaced  # the old tenant field is gone
        assert DAY - 60 < await client.ttl("tito:response:resp_1") <= DAY

        old = stored(2, created_at=time.time() - DAY + 100)  # its TTL counts from created_at
        await store.put(old)
        assert 0 < await client.ttl("tito:response:resp_2") <= 100
        await store.put(stored(3, created_at=time.time() - DAY - 1))  # already expired
        assert await client.exists("tito:response:resp_3") == 0

        assert await store.delete("resp_1") is True
        assert await store.get("resp_1") is None
        assert await store.delete("resp_1") is False
    finally:
        await store.close()
        await client.aclose()


async def test_redis_errors_propagate() -> None:
    store = RedisResponseStore(f"redis://127.0.0.1:{free_port()}/0", DAY, timeout_s=0.5)  # nothing listens
    async with closing(store):
        with pytest.raises(RedisError):
            await store.get("resp_1")
        with pytest.raises(RedisError):
            await store.put(stored(1))


# -- config --


async def test_build_conversation_store(tmp_path: Path) -> None:
    assert build_conversation_store(ConversationStoreConfig(backend="none")) is None
    sqlite = build_conversation_store(ConversationStoreConfig(path=str(tmp_path / "r.sqlite3")))
    assert isinstance(sqlite, SqliteResponseStore)
    await sqlite.close()
    assert isinstance(build_conversation_store(ConversationStoreConfig(backend="redis")), RedisResponseStore)
    with pytest.raises(pydantic.ValidationError):
        ConversationStoreConfig.model_validate({"ttl": 5})  # a misspelt key
    with pytest.raises(pydantic.ValidationError):
        ConversationStoreConfig(ttl_s=0)
