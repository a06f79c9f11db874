"""The commands behind the CLI's verbs, one module per verb, each called by a thin command in finetune/cli.py."""
