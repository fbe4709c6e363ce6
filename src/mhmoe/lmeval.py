"""Deprecated location: use :mod:`mhmoe.integrations.lmeval` (this alias re-exports
``MHMoEHarnessLM`` and, like it, registers the lm-eval backend ``mhmoe``; it warns once)."""

from __future__ import annotations

import warnings

from mhmoe.integrations.lmeval import MHMoEHarnessLM

warnings.warn("mhmoe.lmeval moved to mhmoe.integrations.lmeval", DeprecationWarning, stacklevel=2)

__all__ = ["MHMoEHarnessLM"]
