"""The public name of the job side's data types (`plexrl.types.X`); they are defined in plexrl/api/types.py."""

from plexrl.api.types import *  # noqa: F401,F403
from plexrl.api.types import __all__  # noqa: F401
