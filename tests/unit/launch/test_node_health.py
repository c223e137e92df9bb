"""Which nodes of an allocation the Slurm driver counts as lost (launch/node_health.py), read
from `scontrol show node -o` lines as Slurm 22.05 prints them."""

from relax_slurm.launch.node_health import node_states, unfit

SHOW_NODE = """\
NodeName=ci0 Arch=x86_64 CoresPerSocket=1  CPUAlloc=4 Gres=gpu:8 NodeAddr=127.0.0.1 State=MIXED ThreadsPerCore=1
NodeName=ci1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=4 Gres=gpu:8 NodeAddr=127.0.0.1 State=MIXED+DRAIN ThreadsPerCore=1 Reason=bad gpu [root@2026-11-25T10:40:00]
NodeName=gpu003 Arch=x86_64 State=ALLOCATED+NOT_RESPONDING Weight=1
NodeName=gpu004 Arch=x86_64 State=DOWN+NOT_RESPONDING Weight=1
NodeName=gpu005 Arch=x86_64 State=ALLOCATED+COMPLETING Weight=1
"""


def test_states_are_read_per_node():
    assert node_states(SHOW_NODE) == {
        "ci0": "MIXED", "ci1": "MIXED+DRAIN", "gpu003": "ALLOCATED+NOT_RESPONDING",
        "gpu004": "DOWN+NOT_RESPONDING", "gpu005": "ALLOCATED+COMPLETING"}


def test_drained_down_and_silent_nodes_are_unfit_busy_ones_are_not():
    assert unfit(node_states(SHOW_NODE)) == {
        "ci1": "MIXED+DRAIN", "gpu003": "ALLOCATED+NOT_RESPONDING",
        "gpu004": "DOWN+NOT_RESPONDING"}
    assert unfit({"n1": "IDLE*", "n2": "ALLOCATED", "n3": "MIXED+FAIL"}) == {
        "n1": "IDLE*", "n3": "MIXED+FAIL"}
