"""The sft stage: supervised fine-tuning through LLaMA-Factory (`python -m stages.sft --help`)."""
