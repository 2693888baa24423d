"""Test support shipped with the package (loaded by name, never imported by production code)."""
