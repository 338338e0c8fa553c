"""The pipeline's stages, one package each: `python -m stages.<name>` runs one (synth, sft, rl, eval)."""
