"""The ``compress`` command line."""
