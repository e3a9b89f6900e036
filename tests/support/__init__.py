"""Shared test helpers: fake ranks and their entries, run and patch fixtures, files the tests read."""
