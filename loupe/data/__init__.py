"""Task data: the task record format, the synthetic visual-search generator and benchmark readers."""
