"""Who is calling: API keys and the tenants they belong to.

`--api-keys FILE` holds one `TENANT KEY` pair a line (blank lines and `#` comments ignored). Keys
start with `tml-`, as the Tinker SDK insists before it sends one. A key is looked up by comparing
it, in constant time, with every known key (no early exit, no dictionary lookup on the secret),
and is never logged or echoed: errors name the line, never the key.

A line `@operator KEY` gives a key to the cluster's operator: it reads `/metrics` and the
dashboard (every tenant's jobs), and nothing else; a tenant's key reads neither.

Without a key file the server has one tenant, `DEFAULT_TENANT`, and takes any key the SDK sends:
the CLI then binds only a loopback address.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

from plexrl.api import errors
from plexrl.api.cluster import NAME_RULE, check_name

DEFAULT_TENANT = "local"
KEY_PREFIX = "tml-"
OPERATOR = "@operator"


@dataclass(frozen=True)
class Tenants:
    keys: tuple[tuple[bytes, str], ...] = ()  # (key, tenant); empty: one tenant, no keys
    operators: tuple[bytes, ...] = ()  # the operator's keys

    @property
    def open(self) -> bool:
        return not self.keys

    @classmethod
    def from_file(cls, path: str | Path) -> "Tenants":
        pairs: list[tuple[bytes, str]] = []
        operators: list[bytes] = []
        text = Path(path).read_text()
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise errors.ConfigError(f"{path}:{number}: expected 'TENANT KEY' (two words), got {len(parts)} words")
            tenant, key = parts
            if tenant != OPERATOR:
                try:
                    check_name("tenant", tenant)
                except errors.InvalidInput:
                    raise errors.ConfigError(f"{path}:{number}: tenant {tenant!r}; expected {NAME_RULE} "
                                             f"(or {OPERATOR} for the operator's key)") from None
            if not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + 16:
                raise errors.ConfigError(f"{path}:{number}: the key of {tenant!r} must start with "
                                         f"{KEY_PREFIX!r} and have at least 16 more characters")
            if any(hmac.compare_digest(key.encode(), known) for known in [k for k, _ in pairs] + operators):
                raise errors.ConfigError(f"{path}:{number}: the key of {tenant!r} is also on an earlier line")
            if tenant == OPERATOR:
                operators.append(key.encode())
            else:
                pairs.append((key.encode(), tenant))
        if not pairs:
            raise errors.ConfigError(f"{path}: no 'TENANT KEY' lines")
        return cls(tuple(pairs), tuple(operators))

    def tenant_of(self, key: str | None) -> str | None:
        """The tenant whose key this is, or None. Every known key is compared, in constant time."""
        if self.open:
            return DEFAULT_TENANT
        if not key:
            return None
        given = key.encode()
        found = None
        for known, tenant in self.keys:
            if hmac.compare_digest(given, known):
                found = tenant
        return found

    def is_operator(self, key: str | None) -> bool:
        """Whether `key` is an operator's (every key is, on a server without keys). Constant time."""
        if self.open:
            return True
        given = (key or "").encode()
        found = False
        for known in self.operators:
            found |= hmac.compare_digest(given, known)
        return found
