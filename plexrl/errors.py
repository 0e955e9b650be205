"""The public name of the job side's exceptions (`plexrl.errors.X`); they are defined in plexrl/api/errors.py."""

from plexrl.api.errors import *  # noqa: F401,F403
from plexrl.api.errors import __all__  # noqa: F401
