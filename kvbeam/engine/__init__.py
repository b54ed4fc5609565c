"""kvbeam.engine: the engine-side library (placeholder docstring; replaced at merge)."""
