"""Ordering: the happens-before verifier and the crash context (docs/ARCHITECTURE.md, "The ordering rules")."""

import os

from ninfer_rt.ordering.crash import CrashContext, OpRing
from ninfer_rt.ordering.verifier import OpRef, OrderingViolation, Span, Timeline, Verifier

__all__ = ["CrashContext", "OpRef", "OpRing", "OrderingViolation", "Span", "Timeline", "Verifier", "verify_by_default"]


def verify_by_default() -> bool:
    """True when NINFER_VERIFY_ORDERING asks for the verifier (tests set it; the CLI flag sets it)."""
    return os.environ.get("NINFER_VERIFY_ORDERING", "0").lower() not in ("", "0", "false", "no", "off")
