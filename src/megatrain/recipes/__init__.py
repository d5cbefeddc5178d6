"""Recipes: what a command runs, from config to finished run (SFT/pre-training, GRPO)."""
