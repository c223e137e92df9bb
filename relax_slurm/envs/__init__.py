"""Environments for multi-turn (agentic) rollouts: the interface, the registry, built-ins.

- `BaseEnv`, `StepResult`: the interface (see envs/base.py);
- `register_env` (envs/registration.py), `env_factory` (envs/registry.py): environments by name
  or dotted path;
- `tool` (envs/tools.py): `<tool_call>` JSON calls to a calculator and a sandboxed Python
  runner (envs/sandbox.py), results returned as tool messages;
- `arith_feedback` (envs/arith_feedback.py): answer "a+b=", get "+" / "-" hints, try again
  (the tiny multi-turn task of `experiment=tiny_agent_cpu`).
"""

from relax_slurm.envs.base import BaseEnv, EnvError, Message, StepResult
from relax_slurm.envs.registration import register_env
from relax_slurm.envs.registry import env_factory, names, resolve

__all__ = ["BaseEnv", "EnvError", "Message", "StepResult", "env_factory", "names",
           "register_env", "resolve"]
