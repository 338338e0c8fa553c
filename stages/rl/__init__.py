"""The rl stage: GRPO-family RL on multi-turn zoom-in rollouts, on Ray (`python -m stages.rl`)."""
