"""The broker's answers to resent requests: a client whose reply was lost (or whose broker
restarted in place, replaying them from the spill) sends the same request id again and gets
the same reply frames, the operation not run twice.

Bounded: the latest `per_client` answers of the latest `clients` routing ids.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

ANSWERS_PER_CLIENT = 64  # a client resends only its latest requests
ANSWERED_CLIENTS = 1024


class AnswerCache:
    def __init__(self, per_client: int = ANSWERS_PER_CLIENT,
                 clients: int = ANSWERED_CLIENTS) -> None:
        self.per_client, self.clients = per_client, clients
        # identity -> rid -> reply frames, most recent identity last
        self._answers: OrderedDict[bytes, OrderedDict[Any, list[Any]]] = OrderedDict()

    def remember(self, identity: bytes, rid: Any, frames: list[Any]) -> None:
        per = self._answers.pop(identity, None) or OrderedDict()
        self._answers[identity] = per
        per[rid] = frames
        while len(per) > self.per_client:
            per.popitem(last=False)
        while len(self._answers) > self.clients:
            self._answers.popitem(last=False)

    def get(self, identity: bytes, rid: Any) -> list[Any] | None:
        """The reply frames of a request answered before, or None."""
        return self._answers.get(identity, {}).get(rid)
