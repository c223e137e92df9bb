"""The tiny models and tasks of the CPU presets (experiment=tiny_*), built locally: no hub.

`model` (the tiny Qwen3; `--kind vl|vl3|audio` the multimodal siblings from `multimodal`),
`tokenizer` (their character tokenizer), `arith` (the "a+b=" prompts), `longtail` (the "d*n="
prompts of the long-tail benchmark, answers of heavy-tailed length), `media_tasks` (colours,
colour changes, tones) and `assets` (what a tiny preset needs, built on first use). The
scripts in tools/ are their command lines.
"""
