"""compress: from a Hugging Face checkpoint to a validated edge engine, in one command."""

from compress.core.versions import __version__

__all__ = ["__version__", "run"]


def run(target: str, recipe: str = "default", **options):
    """Run the pipeline from Python with the CLI's options (see :func:`compress.pipeline.execute.run_python`)."""
    from compress.pipeline.execute import run_python  # lazy: `import compress` must not load torch

    return run_python(target, recipe, **options)
