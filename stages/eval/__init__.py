"""The eval stage: benchmarks from local copies, Avg@K, pass@K and turn-scaling curves (`python -m stages.eval`)."""
