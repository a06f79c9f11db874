"""The training process: its worker entry, preflight checks, heap and CUDA allocator settings, signals and SLURM."""
