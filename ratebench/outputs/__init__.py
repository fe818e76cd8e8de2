"""Outputs of the verifier, one module per format: json, markdown, plots, console."""
