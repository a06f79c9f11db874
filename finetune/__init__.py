"""finetune: fine-tune Hugging Face causal language models from YAML recipes, with a memory planner."""

__version__ = "0.1.0"
