"""NUMA topology: which cpus belong to which node, read from sysfs (or given, for tests).

Linux lists nodes as /sys/devices/system/node/node<N>/cpulist ("0-7,16-23"). Only the cpus this process
may run on (sched_getaffinity) are used; nodes left without cpus are dropped. Without sysfs (containers
that hide it, other OSes) everything is one node.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

SYSFS_NODES = "/sys/devices/system/node"


def parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


@dataclass(frozen=True)
class Topology:
    """nodes[i] = the cpus of NUMA node i that this executor may use."""

    nodes: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        nodes = tuple(tuple(int(c) for c in n) for n in self.nodes)
        object.__setattr__(self, "nodes", nodes)
        if not nodes or any(not n for n in nodes):
            raise ValueError(f"Topology needs at least one node and a cpu in every node, got {nodes}")
        if len(nodes) > 8:
            raise ValueError(f"Topology: at most 8 NUMA nodes are supported, got {len(nodes)}")
        if any(c < 0 for n in nodes for c in n):
            raise ValueError("Topology: cpu ids must be >= 0")

    @property
    def threads(self) -> int:
        return sum(len(n) for n in self.nodes)

    @classmethod
    def discover(cls, sysfs_root: str | os.PathLike = SYSFS_NODES, allowed=None) -> "Topology":
        allowed = set(os.sched_getaffinity(0) if allowed is None else allowed)
        nodes = []
        root = Path(sysfs_root)
        dirs = sorted((d for d in root.glob("node*") if re.fullmatch(r"node\d+", d.name)),
                      key=lambda d: int(d.name[4:])) if root.is_dir() else []
        for d in dirs:
            try:
                cpus = [c for c in parse_cpulist((d / "cpulist").read_text()) if c in allowed]
            except OSError:
                continue
            if cpus:
                nodes.append(tuple(cpus))
        if not nodes:
            nodes = [tuple(sorted(allowed))]
        return cls(tuple(nodes))

    def limit(self, threads: int | None) -> "Topology":
        """Keep `threads` cpus, spread over the nodes in proportion to their sizes (at least one each
        while threads allow; nodes that get none are dropped)."""
        if threads is None or threads >= self.threads:
            return self
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        take = [0] * len(self.nodes)
        order = sorted(range(len(self.nodes)), key=lambda i: -len(self.nodes[i]))
        for i in range(threads):  # round robin over the nodes, biggest first
            for j in order[i % len(order):] + order[:i % len(order)]:
                if take[j] < len(self.nodes[j]):
                    take[j] += 1
                    break
        return Topology(tuple(n[:k] for n, k in zip(self.nodes, take) if k))
