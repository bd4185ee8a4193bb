"""Stored OpenAI Responses (`store: true`, `previous_response_id`, GET and DELETE
`/v1/responses/{id}`): each stored response is kept in a backend every processor worker can
reach, since the next turn of a conversation may land on any of them. SQLite serves one host
(every worker process there opens the same file); Redis serves replicas on many hosts.

Nothing here blocks the event loop: SQLite runs on one dedicated thread per store, Redis
through its asyncio client. Errors propagate as exceptions (the caller answers 503)."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.typing import EncodableT, FieldT

from ext_proc.config import ConversationStoreConfig

T = TypeVar("T")

SCHEMA_VERSION = 1  # SQLite's `PRAGMA user_version` of a file this module made
BUSY_TIMEOUT_S = 5.0  # a put waits this long for another worker's write to finish
SWEEP_INTERVAL_S = 60.0  # expired SQLite rows are deleted at most this often (per store)
REDIS_TIMEOUT_S = 1.0  # per Redis call, connecting and its one retry included


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: what GET returns, and what the next turn needs to continue it."""

    id: str  # "resp_..."
    tenant: str | None  # the API key's tenant that made it (None: no tenancy); only it may read it
    response: bytes  # the response object's JSON, as GET /v1/responses/{id} returns it
    messages: bytes  # JSON list: the chat messages the turn was rendered from, carried into the next turn
    input_items: bytes  # JSON list: the turn's input items (each with an "id"), for GET .../input_items
    created_at: float  # unix time


class ResponseStore(Protocol):
    async def put(self, stored: StoredResponse) -> None:
        """Insert, or replace the one with the same id."""

    async def get(self, response_id: str) -> StoredResponse | None:
        """None: unknown, deleted or expired."""

    async def delete(self, response_id: str) -> bool:
        """True if it was there (and not expired)."""

    async def close(self) -> None: ...


# One statement each: `executescript` would commit the transaction that creates them.
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, tenant TEXT, created_at REAL NOT NULL,"
    " response BLOB NOT NULL, messages BLOB NOT NULL, input_items BLOB NOT NULL)",
    "CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at)",  # expiry and the cap
)
_COLUMNS = "id, tenant, response, messages, input_items, created_at"  # StoredResponse's order


class SqliteResponseStore:
    """One SQLite file shared by every worker process on a host. The stdlib driver blocks, so
    every call runs on this store's one thread (which also owns the connection: a sqlite3
    connection stays on the thread that opened it)."""

    def __init__(
        self, path: str, ttl_s: float, max_entries: int, *, sweep_interval_s: float = SWEEP_INTERVAL_S
    ) -> None:
        self._path = path
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._sweep_interval_s = sweep_interval_s
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tito-responses-sqlite"
        )
        # touched only on the executor's thread
        self._db: sqlite3.Connection | None = None
        self._last_sweep = -float("inf")

    async def put(self, stored: StoredResponse) -> None:
        await self._run(self._put, stored)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._run(self._get, response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._run(self._delete, response_id)

    async def close(self) -> None:
        """Closes the connection once the calls queued before it are done; calls made from
        now on raise (none can reopen the connection behind it)."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(executor, self._close)
        finally:
            executor.shutdown(wait=False)  # its queue is empty: the thread ends at once

    async def _run(self, call: Callable[..., T], *args: object) -> T:
        if self._executor is None:
            raise RuntimeError("the response store is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, call, *args)

    # -- on the executor's thread --

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = self._open()
        return self._db

    def _open(self) -> sqlite3.Connection:
        Path(self._path).parent.mkdir(parents=True, exist_ok=True)
        # autocommit (isolation_level None): transactions are begun explicitly, below
        db = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            # WAL: readers never wait for the writer, and a put commits without rewriting
            # pages; NORMAL sync is safe with WAL (a power cut may lose the last puts only).
            _to_wal(db)
            db.execute("PRAGMA synchronous=NORMAL")
            with _transaction(db):  # several workers may open a new file at once
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version == 0:
                    for statement in _SCHEMA:
                        db.execute(statement)
                    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                elif version != SCHEMA_VERSION:
                    raise RuntimeError(
                        f"{self._path} holds response store schema {version}, this gateway's is "
                        f"{SCHEMA_VERSION}: move the file away (or set conversation_store.path)"
                    )
        except BaseException:
            db.close()
            raise
        return db

    def _put(self, stored: StoredResponse) -> None:
        db = self._connection()
        row = (stored.id, stored.tenant, stored.response, stored.messages, stored.input_items, stored.created_at)
        with _transaction(db):
            db.execute(f"INSERT OR REPLACE INTO responses ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)", row)
            now = time.monotonic()
            if now - self._last_sweep >= self._sweep_interval_s:
                self._last_sweep = now
                db.execute("DELETE FROM responses WHERE created_at <= ?", (time.time() - self._ttl_s,))
            # COUNT walks the created_at index's pages, not its rows: cheap enough for every put
            over = db.execute("SELECT COUNT(*) FROM responses").fetchone()[0] - self._max_entries
            if over > 0:
                db.execute(
                    "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses ORDER BY created_at LIMIT ?)",
                    (over,),
                )

    def _get(self, response_id: str) -> StoredResponse | None:
        row = (
            self._connection()
            .execute(
                f"SELECT {_COLUMNS} FROM responses WHERE id = ? AND created_at > ?",
                (response_id, time.time() - self._ttl_s),  # not swept yet is still expired
            )
            .fetchone()
        )
        return None if row is None else StoredResponse(*row)

    def _delete(self, response_id: str) -> bool:
        cursor = self._connection().execute(
            "DELETE FROM responses WHERE id = ? AND created_at > ?", (response_id, time.time() - self._ttl_s)
        )
        return cursor.rowcount > 0  # an expired row stays for the sweep: it was not there

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _to_wal(db: sqlite3.Connection) -> None:
    """`PRAGMA journal_mode=WAL`, retried until the busy timeout. The switch writes from
    inside a read, and SQLite then refuses at once ("database is locked", no busy handler)
    while another connection writes: two workers opening a new file at once (2-9 in 200
    concurrent opens on 2 busy cores)."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)  # on the store's own thread, never the event loop


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on an error). IMMEDIATE takes the write lock up
    front, waiting out another worker's write (busy timeout): a deferred transaction that
    reads first and writes later can fail at once instead of waiting."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


class RedisResponseStore:
    """One Redis hash per response, its TTL set in the same transaction as its fields, so no
    response is ever stored without an expiry. Keys and values are never logged (responses
    are users' data)."""

    def __init__(
        self, url: str, ttl_s: float, key_prefix: str = "tito:response:", *, timeout_s: float = REDIS_TIMEOUT_S
    ) -> None:
        self._url = url
        self._ttl_s = ttl_s
        self._prefix = key_prefix
        self._timeout_s = timeout_s
        self._client: aioredis.Redis | None = None

    async def put(self, stored: StoredResponse) -> None:
        key = self._prefix + stored.id
        # relative to this host's clock, as created_at is: Redis's clock may differ
        ttl_ms = int((stored.created_at + self._ttl_s - time.time()) * 1000)
        fields: dict[FieldT, EncodableT] = {
            "response": stored.response,
            "messages": stored.messages,
            "input_items": stored.input_items,
            "created_at": repr(stored.created_at),
        }
        if stored.tenant is not None:
            fields["tenant"] = stored.tenant
        async with asyncio.timeout(self._timeout_s):
            pipe = self._redis().pipeline(transaction=True)  # MULTI ... EXEC
            pipe.delete(key)  # a replaced response keeps none of its old fields
            if ttl_ms > 0:
                pipe.hset(key, mapping=fields)
                pipe.pexpire(key, ttl_ms)
            await pipe.execute()

    async def get(self, response_id: str) -> StoredResponse | None:
        async with asyncio.timeout(self._timeout_s):
            raw = await self._redis().hgetall(self._prefix + response_id)
        fields = cast(dict[bytes, bytes], raw)  # (decode_responses is off: bytes, never str)
        if not fields:
            return None
        created_at = float(fields[b"created_at"])
        if created_at + self._ttl_s <= time.time():  # (Redis's clock may be behind this host's)
            return None
        tenant = fields.get(b"tenant")
        return StoredResponse(
            id=response_id,
            tenant=None if tenant is None else tenant.decode(),
            response=fields[b"response"],
            messages=fields[b"messages"],
            input_items=fields[b"input_items"],
            created_at=created_at,
        )

    async def delete(self, response_id: str) -> bool:
        async with asyncio.timeout(self._timeout_s):
            deleted: int = await self._redis().delete(self._prefix + response_id)
        return deleted > 0

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _redis(self) -> aioredis.Redis:
        """The client, made on first use inside the running loop (as the token quotas make
        theirs): one immediate retry reconnects a pooled connection a restarted Redis dropped,
        and the socket timeouts end a dead attempt early."""
        if self._client is None:
            self._client = aioredis.Redis.from_url(
                self._url,
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                retry=Retry(NoBackoff(), 1),
            )
        return self._client


def build_conversation_store(config: ConversationStoreConfig) -> ResponseStore | None:
    """The configured store; None when `backend` is `none` (nothing is kept)."""
    if config.backend == "sqlite":
        return SqliteResponseStore(config.path, config.ttl_s, config.max_entries)
    if config.backend == "redis":
        return RedisResponseStore(config.redis_url, config.ttl_s)
    return None
