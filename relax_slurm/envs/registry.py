"""Environments by name (`@register_env("name")` on a class or factory, envs/registration.py),
`env_factory(cfg)`.

`env.name` in the config is a registered name (`names()`) or a dotted path
`package.module:attr` to a `BaseEnv` subclass or to any callable returning an environment.
`env.kwargs` are passed to it as keyword arguments, once per episode.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable

from relax_slurm import user_code
from relax_slurm.envs.base import BaseEnv, EnvError
from relax_slurm.errors import ConfigError
from relax_slurm.envs.registration import EnvFactory, registered, registered_names


def names() -> list[str]:
    _load_builtins()
    return registered_names()


def _load_builtins() -> None:
    import relax_slurm.envs.arith_feedback  # noqa: F401  (registers on import)
    import relax_slurm.envs.tools  # noqa: F401


def resolve(name: str) -> EnvFactory:
    """The factory of a registered name, of a `module:attr` path or of a `file.py:attr`
    (relax_slurm/user_code.py); EnvError names the fix."""
    _load_builtins()
    factory = registered(name)
    if factory is not None:
        return factory
    if not user_code.is_user_code(name):
        raise EnvError(f"env.name={name!r}: not a registered environment ({', '.join(names())}) "
                       "nor a dotted path package.module:attr (or path/to/file.py:attr)")
    try:
        obj = user_code.load(name, "env.name")
    except ConfigError as e:
        raise EnvError(str(e)) from e
    if not callable(obj):
        raise EnvError(f"env.name={name!r} is a {type(obj).__name__}, not a class or "
                       "function that builds an environment")
    return obj


def env_factory(name: str, kwargs: dict[str, Any] | None = None) -> Callable[[], BaseEnv]:
    """A zero-argument callable building a fresh environment per episode. One environment is
    built here, and closed, so that a wrong name or keyword fails at start-up."""
    factory, kw = resolve(name), dict(kwargs or {})

    def make() -> BaseEnv:
        try:
            env = factory(**kw)
        except TypeError as e:
            raise EnvError(f"env.name={name!r} with env.kwargs={kw}: {e}") from e
        for method in ("reset", "step", "format_observation", "close"):
            if not callable(getattr(env, method, None)):
                raise EnvError(f"env.name={name!r} built a {type(env).__name__} without a "
                               f"{method}() method; subclass relax_slurm.envs.BaseEnv")
        return env

    close = make().close()
    if inspect.isawaitable(close):
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop here (the worker's start-up): run it to its end
            asyncio.run(_wait(close))
        else:  # inside a loop: close it there
            asyncio.ensure_future(close)
    return make


async def _wait(awaitable: Any) -> None:
    await awaitable
