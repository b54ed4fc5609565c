"""CLI subcommands: one module each, exposing ``NAME``, ``HELP``, ``add_arguments`` and ``run``."""
