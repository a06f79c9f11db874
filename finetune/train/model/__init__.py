"""The model a plan asks for: built on the meta device, loaded shard by shard or seeded, quantized, and the reference copy."""
