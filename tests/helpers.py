"""Small builders shared by the test modules."""

from __future__ import annotations

import plexrl


def datum(ids, **extra) -> plexrl.Datum:
    """A next-token datum over `ids` (Tinker convention: targets are the inputs shifted by one)."""
    return plexrl.Datum(plexrl.ModelInput.from_ints(ids[:-1]), {"target_tokens": ids[1:], **extra})
