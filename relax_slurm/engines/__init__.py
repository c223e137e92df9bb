"""The SGLang HTTP protocol and its clients, neutral ground: the rollout worker, the weight
sync, the launcher, the trainer and the rewards all talk to engines through it, and it imports
none of them (`sglang_api`: the routes, fields and version checks; `client`: sync and async
clients, the health wait)."""
