"""Benchmarks: wrapped vs plain parity, wrapper overhead, MAML speed, quality, scaling."""
