"""The eval stage: benchmarks from local copies, Avg@K, pass@K and turn-scaling curves, and the comparison of
several models on the same questions (`python -m stages.eval`)."""
