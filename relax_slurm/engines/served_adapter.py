"""Which adapter a model.lora policy's /generate names: one name per weight version.

Each adapter-only sync of version v loads the adapter under a name of its own,
`policy-v<v>`, beside the ones before it, labels the engine's weights v
(/update_weight_version), and the sender unloads `policy-v<v - window>` afterwards
(weightsync/sender.py; window = algo.max_staleness + 1). A name is never replaced in place,
which is what lets generation go on through a sync (docs/lora.md#versioned-adapters): SGLang
unloads an adapter only once no request uses it, holding its adapter lock while it waits (a load
waits on that lock), and refuses a request that names an adapter it does not hold.

A request names the newest version this engine is known to hold: its own label from its latest
answer, or the policy version the broker announced (every engine of the cohort loaded it before
the broker heard of it). An answer's tokens all come from the adapter its request named, so that
version, not the engine's label at the end (which a sync may have moved meanwhile), is the
version the tokens are stamped with. An engine that holds no adapter of that name (restarted
since, or the name fell out of the window) refuses; the client then asks the engine's label and
names that once more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Optional

from relax_slurm.engines.sglang_api import ADAPTER_NAME
from relax_slurm.errors import EngineError, EngineUnreachable

MISSING = ("not loaded", "never been loaded", "implicitly load", "does not exist")
"""Words of SGLang's (and the hf engine's) refusals of an adapter name it does not hold: at
/generate (never loaded; unloaded since: it then fails to reload "__tensor__" implicitly) and
at /unload_lora_adapter."""
PRESENT = ("already loaded", "already exists")
"""Words of their refusal to load a name they hold (a resend of the same version after a failed
sync: the same tensors)."""


def adapter_name(version: int) -> str:
    """The name version `version`'s adapter is served under."""
    return f"{ADAPTER_NAME}-v{int(version)}"


def names_missing(message: str) -> bool:
    return any(words in message for words in MISSING)


def names_present(message: str) -> bool:
    return any(words in message for words in PRESENT)


def label_version(label: Optional[str]) -> Optional[int]:
    """An engine's weight_version label as a version; None before the first sync ("default")."""
    try:
        return None if label is None else int(label)
    except ValueError:
        return None


class ServedAdapter:
    """One engine's newest adapter version, as one client knows it."""

    def __init__(self, announced: Callable[[], Optional[int]] = lambda: None) -> None:
        self.announced = announced
        """The policy version the broker announced (None: not known)."""
        self.seen: Optional[int] = None
        """The newest label this engine answered with."""

    def version(self) -> Optional[int]:
        known = [v for v in (self.seen, self.announced()) if v is not None]
        return max(known) if known else None

    def note(self, label: Optional[str]) -> None:
        v = label_version(label)
        if v is not None and (self.seen is None or v > self.seen):
            self.seen = v

    def forget(self) -> None:
        """The engine refused the name: trust only its own label from now on."""
        self.seen = None


def stamped(results: list, version: int) -> list:
    """Answers to a request that named version `version`'s adapter: every token is that
    version's (GenerateResult.weight_version; no spans)."""
    return [dataclasses.replace(r, weight_version=str(version), weight_versions=[])
            for r in results]


def _refused(e: EngineError) -> bool:
    """An engine's refusal of an adapter name it does not hold (not an engine down)."""
    return not isinstance(e, EngineUnreachable) and names_missing(str(e))


def _none_served(url: str, label: Optional[str], e: Optional[EngineError]) -> EngineUnreachable:
    """The engine serves no adapter a request could name (restarted and not synced yet): the
    caller tries again later, as for an engine that is down."""
    why = f" ({e})" if e is not None else ""
    return EngineUnreachable(f"engine {url}: serves no policy adapter under its weight "
                             f"version {label!r} yet{why}")


async def newest_held(client, send: Callable[[str], Awaitable[list]]) -> list:
    """`send(name)` naming the newest adapter `client`'s engine is known to hold (its
    `client.adapter`); once more under the engine's own label when it refuses that name."""
    adapter, refused = client.adapter, None
    version = adapter.version()
    for _ in range(2):
        label = None
        if version is None:  # ask the engine
            label = await client.weight_version()
            adapter.note(label)
            version = label_version(label)
            if version is None:
                raise _none_served(client.url, label, refused)
        try:
            results = await send(adapter_name(version))
        except EngineError as e:
            if not _refused(e):
                raise
            if label is not None:  # the name of the engine's own label, refused too
                raise _none_served(client.url, label, e) from e
            adapter.forget()
            refused, version = e, None
            continue
        for r in results:
            adapter.note(r.weight_version)
        return stamped(results, version)
    raise AssertionError("unreachable")


def by_own_label(client, send: Callable[[str], list]) -> list:
    """`send(name)` naming the adapter of the engine's own label, asked first (the evaluator's
    few requests: no cache)."""
    label = client.weight_version()
    version = label_version(label)
    if version is None:
        raise _none_served(client.url, label, None)
    try:
        return stamped(send(adapter_name(version)), version)
    except EngineError as e:
        if _refused(e):
            raise _none_served(client.url, label, e) from e
        raise
