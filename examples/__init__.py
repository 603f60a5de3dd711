"""Tested examples of calling ropekv from an engine (see docs/integration.md)."""
