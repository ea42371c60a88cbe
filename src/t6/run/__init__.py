"""A training run: its plan, its execution, what it announces and its closing summary."""
