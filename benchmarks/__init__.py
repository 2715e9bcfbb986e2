"""Benchmarks: `python -m benchmarks.<name>`. Shared timing, environment and results live in
`benchmarks.harness`; each bench file is mostly its parameters."""
