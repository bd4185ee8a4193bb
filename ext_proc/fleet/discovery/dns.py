"""A pool discovered by DNS: every A and AAAA record of a name is an instance at the
configured port (a Kubernetes headless Service, a compose service with replicas, Consul).

The name is resolved again when its records' TTL runs out, within `min_refresh_s` and
`max_refresh_s` (a TTL of 0, dnsmasq's default for its hosts files, means the floor). A name
with no records (NXDOMAIN, or no answer of either type) is a pool with no instance, which is
what a headless Service of no ready pod answers; a lookup that fails (timeout, SERVFAIL, no
server) changes nothing: the last membership stays and the next try comes at the floor.
dnspython's resolver is native asyncio and gives each answer's TTL.
"""

from __future__ import annotations

import asyncio
import logging

import dns.asyncresolver
import dns.exception
import dns.resolver

from ext_proc.config_discovery import DiscoveryConfig
from ext_proc.fleet.discovery import Found, Publish

log = logging.getLogger("tito.discovery")


class DnsSource:
    def __init__(self, settings: DiscoveryConfig) -> None:
        self._settings = settings
        self._resolver = dns.asyncresolver.Resolver(configure=settings.nameserver is None)
        if settings.nameserver is not None:
            host, _, port = settings.nameserver.rpartition(":")
            self._resolver.nameservers = [host.strip("[]")]
            self._resolver.port = int(port)
        self._resolver.lifetime = settings.timeout_s
        self._resolver.cache = None  # the TTL schedules the next lookup; never answer from a cache
        self._failing = False

    async def run(self, publish: Publish) -> None:
        s = self._settings
        while True:
            try:
                found, ttl = await self.lookup()
            except (dns.exception.DNSException, OSError) as error:
                if not self._failing:
                    log.warning("DNS %s: lookup failed (%s); keeping the last membership", s.name, error)
                self._failing = True
                await asyncio.sleep(s.min_refresh_s)
                continue
            if self._failing:
                log.info("DNS %s: answering again", s.name)
            self._failing = False
            publish(found)
            await asyncio.sleep(min(max(ttl, s.min_refresh_s), s.max_refresh_s))

    async def lookup(self) -> tuple[frozenset[Found], float]:
        """The instances the name's records say now, and how long that holds (seconds)."""
        found: set[Found] = set()
        ttls: list[float] = []
        for kind, bracket in (("A", False), ("AAAA", True)):
            try:
                answer = await self._resolver.resolve(self._settings.name, kind, search=True)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            ttls.append(answer.rrset.ttl if answer.rrset is not None else 0)
            for record in answer:
                host = f"[{record.address}]" if bracket else record.address
                found.add(Found(host, self._settings.port))
        return frozenset(found), min(ttls, default=0)
