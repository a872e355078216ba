"""Datasets and their client partitions."""
