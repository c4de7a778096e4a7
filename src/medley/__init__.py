"""medley: plan, simulate and run hybrid-parallel LLM training on mixed accelerators."""

__version__ = "0.1.0"
