"""The model and its training methods: methods as types, adapters, LoRA and NF4 on fused experts, the experts and attention kernels, the router's load-balancing loss, generation."""
