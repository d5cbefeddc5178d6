"""Checkpoints, Hugging Face export and the output folder's rules.

checkpointer.py Checkpointer: save / load / resume path / bytes_needed, one process or sharded
saving.py       the single-process writer (atomic commit, pruning within the run lineage), reader
shards.py       the sharded writer: every rank its part, rank 0 commits
files.py        which files hold a block, the checks as one is read, durable (fsynced) writes
export.py       the Hugging Face folder (export_hf, export_sharded, check_export_target)
rng.py          the RNG states a checkpoint carries
output_dir.py   the run's output folder: lock, claim, overwrite rules, the Ctrl-C message

The names of the files it writes are megatrain/run_files.py's (defined once, imported here).
"""
