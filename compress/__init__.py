"""compress: from a Hugging Face checkpoint to a validated edge engine, in one command."""

__version__ = "0.1.0"


def run(target: str, recipe: str = "default", **options):
    """Run the pipeline from Python with the CLI's options (see :func:`compress.runner.run_python`)."""
    from compress.runner import run_python

    return run_python(target, recipe, **options)
