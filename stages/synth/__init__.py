"""The synth stage: cold-start trajectories from a teacher, filtered, as a LLaMA-Factory dataset (`python -m stages.synth`)."""
