"""ratebench: prove that a per-user output-token rate limit in vLLM keeps its promise."""

__version__ = "0.1.0"
