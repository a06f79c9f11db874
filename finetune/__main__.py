"""``python -m finetune`` is the ``finetune`` command."""

from finetune.cli import main

main()
