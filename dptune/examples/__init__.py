"""Built-in example models for the demo, the tests and the benchmarks."""
