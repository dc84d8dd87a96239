"""Prompts in: the default task (`arith.py`: the step-by-step arithmetic problems, their long
tail of lengths, the shipped data's generator), prompt datasets (`prompts.py`: JSONL or
Parquet rows, verl's files as they are, malformed rows skipped or named) and the resumable
prompt stream (`dataset.py`: a deterministic order per epoch from a `Position` the train state
holds). Host-side only; imports nothing of the project but the tokenizer's loader
(models/hf_io.py) and its own modules (tests/test_tree.py checks it)."""
