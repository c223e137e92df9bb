"""The hf engine: a CPU (or one-GPU) inference server wrapping transformers, speaking SGLang's
native HTTP API, so the rollout worker and the trainer cannot tell it from an SGLang server.

`python -m relax_slurm.engines.hf` (`__main__.py`) is its command line; `core.py` the engine
(`HFEngine`), `state.py` its state, `server.py` the routes, `parsing.py` request parsing,
`batch.py` per-row sampling, `forward.py` the teacher-forced forward and media tensors."""
