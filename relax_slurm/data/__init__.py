"""Prompt datasets (jsonl, parquet, saved HF datasets) and chat rendering."""

from relax_slurm.data.chat import encode, encode_batch, render, to_messages
from relax_slurm.data.dataset import Prompt, PromptDataset, read_prompts, read_table
from relax_slurm.data.tokenizer import load_tokenizer

__all__ = [
    "Prompt",
    "PromptDataset",
    "encode",
    "encode_batch",
    "load_tokenizer",
    "read_prompts",
    "read_table",
    "render",
    "to_messages",
]
