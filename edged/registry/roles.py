"""The operators' roles, in rising order of what they may do (a higher role may do all a lower one may).

``viewer`` reads everything and changes nothing; ``releaser`` publishes versions and releases,
runs rollouts and rollbacks and sets labels and pins; ``admin`` also makes and revokes tokens,
enrollment and re-enrollment tokens, and decommissions devices. Which route needs which is
:data:`edged.registry.access.RULES`.
"""

from __future__ import annotations

import enum


class Role(enum.IntEnum):
    VIEWER = 1
    RELEASER = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()


ROLES = {r.label: r for r in Role}
DEFAULT_OPERATOR_ROLE = Role.RELEASER  # a dashboard operator without a role in operator_roles
