"""The SGLang HTTP protocol and its clients, neutral ground: the rollout worker, the weight
sync, the launcher, the trainer and the rewards all talk to engines through it, and it imports
none of them (`sglang_api`: the routes, fields and version checks; `client`: sync and async
clients, the health wait; `seeds`: the seed arithmetic the worker and the hf engine share).
`hf/` is an engine itself, our transformers server speaking that protocol (`python -m
relax_slurm.engines.hf`); it builds on the rest of the package, which never imports it."""
