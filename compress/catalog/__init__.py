"""What compress ships as data: recipes, targets and text, read through ``importlib.resources`` so an installed wheel
has them.

* ``recipes/*.yaml``: named stage lists with their options;
* ``targets/*.yaml``: hardware facts, power modes and budgets of each deployment target;
* ``text/``: the calibration and evaluation text (``text/PROVENANCE.md`` says where each file comes from).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

RECIPES = "recipes"
TARGETS = "targets"
TEXT = "text"


def catalog_dir(kind: str) -> Path:
    """The folder of one kind of shipped data (``recipes``, ``targets`` or ``text``)."""
    return Path(str(resources.files(__name__).joinpath(kind)))
