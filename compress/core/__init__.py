"""Foundations every layer uses: errors and exit codes, atomic files, typed configuration, artifacts, the run directory,
text."""
