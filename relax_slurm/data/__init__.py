"""Prompt datasets (jsonl, parquet, saved HF datasets) and chat rendering."""

from relax_slurm.data.chat import encode, encode_batch, render, to_messages
from relax_slurm.data.dataset import Prompt, PromptDataset, read_prompts, read_table

__all__ = [
    "Prompt",
    "PromptDataset",
    "encode",
    "encode_batch",
    "read_prompts",
    "read_table",
    "render",
    "to_messages",
]
