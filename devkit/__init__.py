"""Helpers the tests and the benchmarks share (neither imports the other): starting local
engines as `make run` does, and generating LoRA adapters of the tiny model."""
