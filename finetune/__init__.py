"""finetune: fine-tune Hugging Face causal language models from YAML recipes, with a memory planner."""

import logging
import warnings

__version__ = "0.1.0"

# Library chatter that tells a user of this tool nothing (stdlib only: importing finetune stays instant):
# bitsandbytes' note about an optional CPU kernel package, and a transformers deprecation peft triggers.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*", category=FutureWarning)
