"""Accounts: users with roles and passwords, API tokens with scopes, who owns which capsule (all in the
catalogue), and the :class:`Principal` a request acts as. No HTTP here: the agent's ``authz`` maps routes to
what they need, the CLI's ``accounts`` commands are thin shells over these calls."""

from capsule.accounts.model import ROLE_SCOPES, ROLES, SCOPES, Principal

__all__ = ["ROLES", "ROLE_SCOPES", "SCOPES", "Principal"]
