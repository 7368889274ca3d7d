"""CPU limits from cgroup files (`ragckpt.cpus`), read from fake cgroup trees laid out as the kernel
lays them out: v2 (`cpu.max` in the unified hierarchy), v1 (`cpu.cfs_quota_us` under the `cpu`
controller's mount), limits on ancestors, no limit, unreadable or malformed files."""

from __future__ import annotations

import os

import pytest

from ragckpt import cpus
from ragckpt.checkpoint.writer import default_workers


@pytest.fixture(autouse=True)
def fresh_cache():
    """`usable_cpus` is cached for the process: no patched answer may outlive a test."""
    cpus.usable_cpus.cache_clear()
    yield
    cpus.usable_cpus.cache_clear()


def tree(tmp_path, self_cgroup: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    root.mkdir(exist_ok=True)
    me = tmp_path / "self_cgroup"
    me.write_text(self_cgroup)
    return str(root), str(me)


@pytest.mark.parametrize("files, want", [
    ({"kubepods/pod1/cpu.max": "200000 100000\n"}, 2.0),
    ({"kubepods/pod1/cpu.max": "max 100000\n", "kubepods/cpu.max": "150000 100000\n"}, 1.5),  # a parent's limit
    ({"kubepods/pod1/cpu.max": "50000 100000\n", "kubepods/cpu.max": "400000 100000\n"}, 0.5),  # the smallest
    ({"kubepods/pod1/cpu.max": "max 100000\n", "cpu.max": "max 100000\n"}, None),
    ({}, None),
    ({"kubepods/pod1/cpu.max": "garbage\n"}, None),
])
def test_cgroup_v2(tmp_path, files, want):
    root, me = tree(tmp_path, "0::/kubepods/pod1\n", files)
    assert cpus.cgroup_cpu_limit(root, me) == want


@pytest.mark.parametrize("mount", ["cpu,cpuacct", "cpu"])
@pytest.mark.parametrize("quota, want", [("300000", 3.0), ("-1", None), ("x", None)])
def test_cgroup_v1(tmp_path, mount, quota, want):
    me_line = "4:memory:/job\n3:cpu,cpuacct:/docker/abc\n2:cpuset:/\n"
    root, me = tree(tmp_path, me_line, {f"{mount}/docker/abc/cpu.cfs_quota_us": quota + "\n",
                                        f"{mount}/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cpus.cgroup_cpu_limit(root, me) == want


def test_no_cgroup_file_means_no_limit(tmp_path):
    assert cpus.cgroup_cpu_limit(str(tmp_path), str(tmp_path / "absent")) is None


def test_usable_cpus_caps_the_affinity_mask_with_the_quota(monkeypatch):
    mask = len(os.sched_getaffinity(0))
    for limit, want in ((None, mask), (0.5, 1), (1.2, min(mask, 2)), (10_000.0, mask)):
        monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda limit=limit: limit)
        cpus.usable_cpus.cache_clear()
        assert cpus.usable_cpus() == want
    # thread pools follow it: a 1-CPU container gets 2 writer threads whatever the host has
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 1.0)
    cpus.usable_cpus.cache_clear()
    monkeypatch.delenv("RAGCKPT_IO_CONCURRENCY", raising=False)
    assert default_workers() == 2
