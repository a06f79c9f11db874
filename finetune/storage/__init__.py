"""Files: a run directory's reader, safetensors streaming, the staged directory swap, Hub uploads."""
