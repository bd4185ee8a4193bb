"""A real DNS server for the discovery tests: dnsmasq answering from a hosts folder it
watches (the same command `tito up` runs for its elastic pool), on a free loopback port."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from ext_proc.envoy_protocol.endpoints import write_atomically
from ext_proc.tools.elastic_pool import dnsmasq_command


class DnsServer:
    def __init__(self, work: Path, port: int, names: list[str]) -> None:
        self.hosts = work / "dns"
        self.hosts.mkdir(parents=True, exist_ok=True)
        self.nameserver = f"127.0.0.1:{port}"
        self._names = names
        self._process: subprocess.Popen[bytes] | None = None
        self.log = work / "dnsmasq.log"

    @staticmethod
    def available() -> bool:
        return shutil.which("dnsmasq") is not None or Path("/usr/sbin/dnsmasq").exists()

    def start(self) -> DnsServer:
        command = dnsmasq_command(self.nameserver, self.hosts, self._names)
        with self.log.open("ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        time.sleep(0.3)
        if self._process.poll() is not None:
            raise RuntimeError(f"dnsmasq exited: {self.log.read_text()[-2000:]}")
        return self

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)
            self._process = None

    def records(self, name: str, hosts: list[str]) -> None:
        """`name`'s A records are now these (dnsmasq rereads the file at once)."""
        write_atomically(self.hosts / name, "".join(f"{host} {name}\n" for host in hosts).encode())
