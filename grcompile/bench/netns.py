"""An emulated cluster network on one machine: each rank in a network namespace of its own, joined
to a bridge by a veth pair whose two ends are rate-limited by ``tc`` (``tbf``: the rank's NIC,
sending and receiving). A real kernel network path — gloo's TCP pairs go through it — made and
torn down by the benchmark itself; addresses are a private test subnet of our own.

Needs root and ``ip`` / ``tc`` (iproute2). ``netem`` (delay) is not available on these machines,
so the link is emulated by its rate only (plus the kernel's own latency).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

SUBNET = "10.79.0"  # our own test hosts: 10.79.0.1 (bridge), 10.79.0.10 + rank


@dataclass
class RankHost:
    namespace: str
    address: str
    interface: str  # inside the namespace (GLOO_SOCKET_IFNAME)

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]


def unavailable_reason() -> Optional[str]:
    """Why namespaces cannot be made here (``None``: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    return None


class EmulatedNetwork:
    """``with EmulatedNetwork(world, rate_mbit) as hosts:`` one ``RankHost`` per rank; ``rate_mbit``
    ``None`` leaves the links unlimited (the same path, for the compute-only baseline)."""

    def __init__(self, world: int, rate_mbit: Optional[float], tag: Optional[str] = None) -> None:
        self.world, self.rate_mbit = world, rate_mbit
        self.tag = tag or f"{os.getpid() % 10000}"
        self.bridge = f"grb{self.tag}"
        self.hosts: list[RankHost] = []

    def _run(self, *argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, text=True)

    def _limit(self, interface: str, namespace: Optional[str] = None) -> None:
        if self.rate_mbit is None:
            return
        prefix = ["ip", "netns", "exec", namespace] if namespace else []
        # burst: at least one 10 ms worth of bytes (and a few full packets), queue up to 200 ms
        burst = max(int(self.rate_mbit * 1e6 / 8 * 0.01), 32 * 1514)
        self._run(*prefix, "tc", "qdisc", "add", "dev", interface, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                  "burst", str(burst), "latency", "200ms")

    def __enter__(self) -> list[RankHost]:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot emulate a network here: {reason}")
        try:
            self._run("ip", "link", "add", self.bridge, "type", "bridge")
            self._run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
            self._run("ip", "link", "set", self.bridge, "up")
            for rank in range(self.world):
                ns, outside, inside = f"grn{self.tag}r{rank}", f"gro{self.tag}r{rank}", f"gri{self.tag}r{rank}"
                address = f"{SUBNET}.{10 + rank}"
                self._run("ip", "netns", "add", ns)
                self.hosts.append(RankHost(ns, address, inside))
                self._run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
                self._run("ip", "link", "set", inside, "netns", ns)
                self._run("ip", "link", "set", outside, "master", self.bridge)
                self._run("ip", "link", "set", outside, "up")
                self._run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", inside)
                self._run("ip", "netns", "exec", ns, "ip", "link", "set", inside, "up")
                self._run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                self._limit(inside, ns)  # what the rank sends
                self._limit(outside)  # what the rank receives
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.hosts

    def __exit__(self, *exc) -> None:
        for rank, host in enumerate(self.hosts):
            subprocess.run(["ip", "link", "del", f"gro{self.tag}r{rank}"], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.hosts = []


__all__ = ["EmulatedNetwork", "RankHost", "unavailable_reason"]
