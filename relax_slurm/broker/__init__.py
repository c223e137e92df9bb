"""The broker: sample queue, policy version, admission control; ZMQ server and clients."""

from relax_slurm.broker.client import AsyncBrokerClient, BrokerClient, Subscriber
from relax_slurm.broker.server import BrokerServer
from relax_slurm.broker.state import BrokerState
from relax_slurm.broker.wire import decode, encode

__all__ = [
    "AsyncBrokerClient", "BrokerClient", "BrokerServer", "BrokerState", "Subscriber",
    "decode", "encode",
]
