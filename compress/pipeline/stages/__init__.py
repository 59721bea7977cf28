"""The stages, one module each: thin glue between the run and the library code that does the work."""
