"""Managed-mode job modules that the end-to-end tests run on the lab hosts."""
