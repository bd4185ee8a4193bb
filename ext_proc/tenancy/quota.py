"""Per-tenant tokens-per-minute quotas, shared by every processor worker and replica through
Redis, or enforced as an equal share by each process when there is no Redis (or it is down and
the fail mode is `local`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from ext_proc.config_tenancy import TenancyConfig

log = logging.getLogger("tito.quota")

WINDOW_S = 60
KEY_TTL_S = 120  # a window's key outlives its minute, then Redis drops it
RETRY_DOWN_S = 1.0  # while Redis is down, at most one call a second tries it again

# Check-then-charge in one step: two processes reading the count, then both adding, would let
# both through past the limit.
_RESERVE_LUA = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local tokens = tonumber(ARGV[1])
if used + tokens > tonumber(ARGV[2]) then
  return 0
end
redis.call('INCRBY', KEYS[1], tokens)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
"""


class QuotaUnavailable(Exception):
    """Redis is down and `redis_fail_mode` is `refuse`: the caller answers 503."""


class _LocalCounters:
    """This process's tokens per (window, tenant); only the current window is kept."""

    def __init__(self, processes: int) -> None:
        self._processes = max(1, processes)
        self._windows: dict[int, dict[str, int]] = {}

    def share(self, per_minute: int) -> int:
        """The same equal split admission budgets use, never zero (a tenant is never shut out)."""
        return max(1, per_minute // self._processes)

    def reserve(self, tenant: str, tokens: int, per_minute: int, window: int) -> bool:
        used = self._window(window)
        if used.get(tenant, 0) + tokens > self.share(per_minute):
            return False
        used[tenant] = used.get(tenant, 0) + tokens
        return True

    def _window(self, window: int) -> dict[str, int]:
        used = self._windows.get(window)
        if used is None:
            # a new window: older ones can no longer be charged, so memory stays bounded
            self._windows = {w: u for w, u in self._windows.items() if w > window}
            used = self._windows[window] = {}
        return used


def _where(url: str) -> str:
    """HOST:PORT of a Redis URL, without its credentials (safe to log)."""
    parts = urlsplit(url)
    if parts.hostname is None:
        return parts.path  # unix:///path/to/socket
    return f"{parts.hostname}:{parts.port or 6379}"


def _redact(text: str, url: str) -> str:
    """`text` (an error message) with the URL's username and password masked."""
    parts = urlsplit(url)
    for secret in (parts.password, parts.username):
        if secret:
            text = text.replace(secret, "***")
    return text


class _RedisStore:
    """The shared counters; the client is made on first use, inside the running loop."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self._url = url
        self._timeout_s = timeout_s
        self._client: aioredis.Redis | None = None
        self._script: AsyncScript | None = None

    async def reserve(self, key: str, tokens: int, limit: int) -> bool:
        """RedisError on a failure; TimeoutError once `timeout_s` has passed in all (connecting
        and the retry included)."""
        script = self._script or self._connect()
        async with asyncio.timeout(self._timeout_s):  # no extra task per call, unlike wait_for
            granted = await script(keys=[key], args=[tokens, limit, KEY_TTL_S])
        return bool(granted)

    def _connect(self) -> AsyncScript:
        # One immediate retry reconnects a pooled connection that a restarted Redis dropped (the
        # default retries back off for seconds); the socket timeouts end a dead attempt early.
        self._client = aioredis.Redis.from_url(
            self._url,
            socket_timeout=self._timeout_s,
            socket_connect_timeout=self._timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._script = self._client.register_script(_RESERVE_LUA)
        return self._script

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
            self._script = None


class TokenQuota:
    """Tokens per minute per tenant, in fixed one-minute windows (the window's start:
    floor(now/60)*60)."""

    def __init__(self, config: TenancyConfig, processes: int, clock: Callable[[], float] = time.time) -> None:
        self._config = config
        self._clock = clock
        self._local = _LocalCounters(processes)
        self._redis = _RedisStore(config.redis_url, config.redis_timeout_s) if config.redis_url else None
        self._where = _where(config.redis_url) if config.redis_url else ""
        self._redis_up: bool | None = None  # None: no Redis, or not tried yet
        self._retry_at = 0.0  # monotonic; while down, Redis is not tried before this
        self.store_errors = 0  # Redis calls that failed or timed out
        self.fallbacks = 0  # calls answered by the local share because Redis was down
        self.refused = 0  # calls refused (QuotaUnavailable) because Redis was down

    async def reserve(self, tenant: str, tokens: int, per_minute: int) -> float | None:
        """Charge `tokens` to the tenant's current window if it stays within `per_minute`: None.
        Else nothing is charged and the answer is the seconds until the next window
        (Retry-After, > 0). A request larger than the whole quota is never granted: answer the
        seconds to the next window too (callers turn it into 429)."""
        now = self._clock()
        window = int(now // WINDOW_S) * WINDOW_S
        retry_after = WINDOW_S - now % WINDOW_S
        if tokens > per_minute:
            return retry_after
        granted = await self._granted(tenant, tokens, per_minute, window)
        return None if granted else retry_after

    async def _granted(self, tenant: str, tokens: int, per_minute: int, window: int) -> bool:
        if self._redis is None:
            return self._local.reserve(tenant, tokens, per_minute, window)
        if self._redis_due():
            try:
                granted = await self._redis.reserve(f"tito:tpm:{tenant}:{window}", tokens, per_minute)
            except (RedisError, OSError) as error:  # OSError covers TimeoutError
                self._redis_failed(error)
            else:
                self._redis_answered()
                return granted
        if self._config.redis_fail_mode == "refuse":
            self.refused += 1
            raise QuotaUnavailable(f"token quotas: Redis at {self._where} is unreachable")
        self.fallbacks += 1
        return self._local.reserve(tenant, tokens, per_minute, window)

    def _redis_due(self) -> bool:
        """Up (or untried): always. Down: once a second, and that one probe holds the calls
        meanwhile off, so they do not each pay the timeout."""
        if self._redis_up is not False:
            return True
        now = time.monotonic()
        if now < self._retry_at:
            return False
        self._retry_at = now + RETRY_DOWN_S
        return True

    def _redis_failed(self, error: Exception) -> None:
        self.store_errors += 1
        self._retry_at = time.monotonic() + RETRY_DOWN_S
        if self._redis_up is not False:
            self._redis_up = False
            then = "each process enforces its share" if self._config.redis_fail_mode == "local" else "refusing (503)"
            detail = str(error) or f"no answer within {self._config.redis_timeout_s} s"  # the timeout's
            reason = _redact(f"{type(error).__name__}: {detail}", self._config.redis_url or "")
            log.warning("token quotas: Redis at %s unreachable (%s); %s", self._where, reason, then)

    def _redis_answered(self) -> None:
        if self._redis_up is False:
            log.warning("token quotas: Redis at %s reachable again", self._where)
        self._redis_up = True

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.close()

    def snapshot(self) -> dict[str, Any]:
        return {
            "backend": "local" if self._redis is None else "redis",
            "redis_up": self._redis_up,
            "store_errors": self.store_errors,
            "fallbacks": self.fallbacks,
            "refused": self.refused,
        }
