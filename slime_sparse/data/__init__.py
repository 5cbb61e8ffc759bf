"""Prompt data: local jsonl/parquet files -> tokenized prompts -> resumable rollout batches."""
from slime_sparse.data.prompt_dataset import DataConfig, Prompt, PromptDataset, PromptRecord, PromptStream

__all__ = ["DataConfig", "Prompt", "PromptDataset", "PromptRecord", "PromptStream"]
