"""Slurm node lists in every form Slurm prints them, and the allocation read from SLURM_*."""

from __future__ import annotations

import pytest

from relax_slurm.errors import ConfigError
from relax_slurm.launch.slurm_env import expand_nodelist, in_allocation, read_allocation


@pytest.mark.parametrize("text,hosts", [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),                   # no padding: width of "8"
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),                # padding from the lower bound
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a[1-2],b[10-11]", ["a1", "a2", "b10", "b11"]),           # several ranges
    ("gpu2-[8-10],cpu7", ["gpu2-8", "gpu2-9", "gpu2-10", "cpu7"]),  # digits in the prefix
    ("a100n[1-2]", ["a100n1", "a100n2"]),
    ("node[1-2]-ib", ["node1-ib", "node2-ib"]),                # text after the brackets
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("x[5]", ["x5"]),
    ("node1,node2,node3", ["node1", "node2", "node3"]),
    ("ci0", ["ci0"]),
    ("host-a.example.org", ["host-a.example.org"]),
    (" node[1-2] ", ["node1", "node2"]),
    ("", []),
    ("(null)", []),
    ("n[1-2,4-5,9]", ["n1", "n2", "n4", "n5", "n9"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["node[1-2", "node1-2]", "n[2-1]", "n[a-b]", "n[1-]",
                                 "n[[1-2]]", "n[]"])
def test_malformed_nodelist_raises(bad):
    with pytest.raises(ValueError):
        expand_nodelist(bad)


HET_ENV = {
    "SLURM_JOB_ID": "41", "SLURM_HET_SIZE": "2",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu[001-002]",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "gpu[010,012]",
    "SLURM_JOB_NODELIST": "gpu[001-002]",  # the batch host's component only
    "SLURM_RESTART_COUNT": "2", "SLURM_SUBMIT_DIR": "/home/me/project",
}


def test_read_het_allocation():
    alloc = read_allocation(HET_ENV)
    assert alloc.is_het and alloc.job_id == "41" and alloc.restart_count == 2
    assert alloc.nodes(0) == ["gpu001", "gpu002"]
    assert alloc.nodes(1) == ["gpu010", "gpu012"]
    assert alloc.submit_dir == "/home/me/project"


def test_read_plain_allocation():
    alloc = read_allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "cn[1-3]"})
    assert not alloc.is_het and alloc.restart_count == 0
    assert alloc.het_groups == (("cn1", "cn2", "cn3"),)


def test_outside_an_allocation_names_the_variable():
    assert not in_allocation({})
    with pytest.raises(ConfigError, match="SLURM_JOB_ID"):
        read_allocation({})


def test_missing_or_bad_het_group_is_named():
    env = {k: v for k, v in HET_ENV.items() if k != "SLURM_JOB_NODELIST_HET_GROUP_1"}
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST_HET_GROUP_1"):
        read_allocation(env)
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST_HET_GROUP_0.*cannot be parsed"):
        read_allocation({**HET_ENV, "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu[1-"})
