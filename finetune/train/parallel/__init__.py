"""Parallelism: the one layout and its mesh, the process groups, TP/FSDP/DDP/HSDP, experts over ep, the pipeline's stages, the node checks."""
