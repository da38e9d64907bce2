"""Advantage-weighted regression as an offline-plugins plugin (an example package)."""
