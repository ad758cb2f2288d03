"""Drafter training: `python -m train`, `python -m train.generate_data`, `python -m train.export`."""
