"""The trainer: model loading, parallelisation, data, the loop, checkpoints."""
