"""Deprecated location of the restricted DCP reader: import from :mod:`mhmoe.checkpoint.dcp_metadata`
(``read_metadata``, ``check_metadata``, ``ALLOWED_GLOBALS``) and :mod:`mhmoe.checkpoint.dcp_reader`
(``SafeFileSystemReader``, ``read_dcp_full``, ``load_item``). Importing this module warns once."""

from __future__ import annotations

import warnings

from mhmoe.checkpoint.dcp_metadata import ALLOWED_GLOBALS, check_metadata, read_metadata
from mhmoe.checkpoint.dcp_reader import SafeFileSystemReader, load_item, read_dcp_full

warnings.warn("mhmoe.train.dcp_safe moved to mhmoe.checkpoint.dcp_metadata and mhmoe.checkpoint.dcp_reader",
              DeprecationWarning, stacklevel=2)

__all__ = ["ALLOWED_GLOBALS", "SafeFileSystemReader", "check_metadata", "load_item", "read_dcp_full",
           "read_metadata"]
