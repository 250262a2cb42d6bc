"""nereus-lightning: adaptive DP/TP/PP parallelism for LLM RL post-training."""

__version__ = "0.1.0"
