"""What training minimises: the causal LM loss (fused head, chunks), the preference losses, and GRPO's policy loss with its rewards."""
