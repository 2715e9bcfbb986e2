"""Experiment entry points: benchmarks and sweeps (`python -m experiments.<name>`)."""
