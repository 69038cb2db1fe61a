"""Torch-facing public ops, one module per op."""
