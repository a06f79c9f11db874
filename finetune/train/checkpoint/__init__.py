"""Checkpoints: the sharded DCP checkpointer, resuming a run, the final save, the lock on output.dir, early stopping's best."""
