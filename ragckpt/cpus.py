"""How many CPUs this process can keep busy, for sizing thread pools and read pieces.

`os.cpu_count()` counts the machine's cores. A job pinned to some of them (taskset, Slurm's
`--cpus-per-task` binding) sees fewer in its affinity mask, and a container with a CPU limit
(Kubernetes `resources.limits.cpu`, `docker --cpus`) sees every host core in its mask but is
throttled to its cgroup's quota: 16 threads sized for a 64-core host, run under a 2-CPU limit,
crowd each other the way they would on a 2-core machine.
"""

from __future__ import annotations

import functools
import math
import os

CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"


@functools.cache
def usable_cpus() -> int:
    """The CPUs in this process's affinity mask, capped by its cgroup's CPU quota (rounded up)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    return max(1, min(n, math.ceil(limit))) if limit is not None else max(1, n)


def cgroup_cpu_limit(root: str = CGROUP_ROOT, self_cgroup: str = SELF_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (quota / period), the smallest along the path
    from its group up to the root, since a parent's limit binds its children too; None when no
    quota is set or the files cannot be read. cgroup v2 (`cpu.max`) and v1 (`cpu.cfs_quota_us`)."""
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            limits += _limits_along(root, path, _v2_limit)
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu"):  # "cpu,cpuacct", usually also linked as "cpu"
                if os.path.isdir(os.path.join(root, mount)):
                    limits += _limits_along(os.path.join(root, mount), path, _v1_limit)
                    break
    return min(limits) if limits else None


def _limits_along(base: str, path: str, read) -> list[float]:
    """`read(dir)` of the group's directory under `base` and of each ancestor up to `base`."""
    out = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        limit = read(os.path.join(base, *parts[:depth]))
        if limit is not None:
            out.append(limit)
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _v2_limit(d: str) -> float | None:
    text = _read(os.path.join(d, "cpu.max"))  # "<quota> <period>", or "max <period>": no limit
    fields = text.split() if text else []
    return _ratio(fields[0], fields[1]) if len(fields) == 2 else None


def _v1_limit(d: str) -> float | None:
    quota, period = _read(os.path.join(d, "cpu.cfs_quota_us")), _read(os.path.join(d, "cpu.cfs_period_us"))
    if quota is None or period is None:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max"
        return None
    return q / p if q > 0 and p > 0 else None  # v1 writes -1 for no limit
