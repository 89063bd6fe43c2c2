"""Encoder and decoder grouped under one module with one optimizer (per-module learning rates)."""
