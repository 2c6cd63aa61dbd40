"""hybrid: a single-box runtime for big Mixture-of-Experts LLMs (GPU + CPU experts, cost-model split)."""

__version__ = "0.1.0"
