"""Checkpoints, Hugging Face export and the output folder's rules."""
